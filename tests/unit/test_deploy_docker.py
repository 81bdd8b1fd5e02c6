"""deploy/docker/Dockerfile: parsed with Docker's own parser (the `dockerfile` package). The image
cannot be built here, so this checks what the build depends on: a CUDA PyTorch base, the
repository copied in and pip-installed, and elastic-run (a console script of this package) as the
entrypoint, in the working dir the Kubernetes manifests use."""

from __future__ import annotations

import re
from importlib.metadata import distribution
from pathlib import Path

import dockerfile

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
IGNORE = REPO / "deploy" / "docker" / "Dockerfile.dockerignore"


def _commands() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def _args() -> dict[str, str]:
    out = {}
    for c in _commands():
        if c.cmd == "ARG":
            name, _, default = c.value[0].partition("=")
            out[name] = default
    return out


def test_base_image_is_cuda_pytorch() -> None:
    (base,) = [c for c in _commands() if c.cmd == "FROM"]
    image = re.sub(r"\$\{(\w+)\}", lambda m: _args()[m.group(1)], base.value[0])
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-(runtime|devel)", image), image
    requires = distribution("elastic-train").requires or []
    torch_min = next(r for r in requires if re.match(r"torch\b", r))
    major, minor = (int(x) for x in image.split(":")[1].split(".")[:2])
    wanted = tuple(int(x) for x in torch_min.split(">=")[1].split(".")[:2])
    assert (major, minor) >= wanted, f"base image torch {major}.{minor} does not satisfy {torch_min}"


def test_repository_is_copied_and_pip_installed() -> None:
    commands = _commands()
    (workdir,) = [c.value[0] for c in commands if c.cmd == "WORKDIR"]
    copies = [c for c in commands if c.cmd == "COPY"]
    assert any(c.value[0] == "." and c.value[-1] in (workdir, ".", "./") for c in copies), (
        "the build context (repository root) must be copied"
    )
    runs = [c.value[0] for c in commands if c.cmd == "RUN"]
    install = [r for r in runs if re.search(r"\bpip install\b", r)]
    assert install, "no pip install in the Dockerfile"
    assert any(workdir in r or re.search(r"pip install[^&|;]*\s\.(\[|\s|$)", r) for r in install), install
    assert not any("-e " in r or "--editable" in r for r in install), "install the package, not an editable link"
    # The same working dir the trainer pods use, where examples/ lands.
    assert workdir == "/workspace/elastic-train"
    # The extras the image installs by default are ones the package declares.
    declared = set(distribution("elastic-train").metadata.get_all("Provides-Extra") or [])
    assert set(_args()["EXTRAS"].split(",")) <= declared


def _entrypoint_problem(commands: list[dockerfile.Command]) -> str | None:
    entrypoints = [c for c in commands if c.cmd == "ENTRYPOINT"]
    if not entrypoints:
        return "no ENTRYPOINT"
    last = entrypoints[-1]
    if not last.json:
        return "use the exec form, so that elastic-run is PID 1 and receives SIGTERM"
    if list(last.value) != ["elastic-run"]:
        return f"ENTRYPOINT is {list(last.value)}, not ['elastic-run']"
    return None


def test_entrypoint_is_elastic_run() -> None:
    assert _entrypoint_problem(_commands()) is None
    scripts = {ep.name for ep in distribution("elastic-train").entry_points if ep.group == "console_scripts"}
    assert "elastic-run" in scripts, "the package no longer installs an elastic-run console script"


def test_entrypoint_check_rejects_shell_form_and_other_commands(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    for text, problem in (
        ("ENTRYPOINT elastic-run\n", "exec form"),
        ('ENTRYPOINT ["torchrun"]\n', "not ['elastic-run']"),
        ('CMD ["elastic-run"]\n', "no ENTRYPOINT"),
    ):
        bad.write_text("FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime\n" + text)
        found = _entrypoint_problem(list(dockerfile.parse_file(str(bad))))
        assert found is not None and problem in found, (text, found)


def test_build_context_leaves_out_local_state() -> None:
    ignored = {line.strip() for line in IGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    # Nothing the install needs may be ignored.
    for needed in ("pyproject.toml", "elastic", "trainer", "ckpt", "examples"):
        assert needed not in ignored
        assert (REPO / needed).exists()
