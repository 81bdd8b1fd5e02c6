"""elastic-chaos input: the fault catalog, parsing and feasibility, the seeded plan, the config and
the command line's bad-input errors (exit 2, before anything starts)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from chaos import CATALOG, ChaosConfig, parse_faults, plan
from chaos.cli import main
from chaos.faults import FaultSpec, check_feasible
from chaos.scenarios import SCENARIOS
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(30)

MIXED = parse_faults("kill-node,kill-worker,hang-worker,corrupt-checkpoint")


def make_plan(seed: int, specs: tuple[FaultSpec, ...] = MIXED, **kw: int):  # type: ignore[no-untyped-def]
    args = {"steps": 60, "ckpt_every": 5, "nodes": 3, "nproc_per_node": 1, **kw}
    return plan(specs, seed=seed, **args)


def test_parse_faults_with_targets() -> None:
    assert parse_faults("kill-worker, kill-node@last,hang-worker@2,") == (
        FaultSpec("kill-worker"), FaultSpec("kill-node", "last"), FaultSpec("hang-worker", 2))
    assert str(FaultSpec("kill-node", "last")) == "kill-node@last"


@pytest.mark.parametrize("text,message", [
    ("kill-wroker", "unknown fault kind 'kill-wroker'"),
    ("add-node@1", "takes no target"),
    ("kill-node@first", "must be a rank number or 'last'"),
])
def test_parse_faults_rejects_bad_input(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_faults(text)


def test_every_catalog_kind_parses() -> None:
    assert [s.kind for s in parse_faults(",".join(CATALOG))] == list(CATALOG)


def test_feasibility_counts_nodes_in_order() -> None:
    assert check_feasible(parse_faults("kill-node"), nodes=2, nproc_per_node=1, etcd_members=1) == []
    (problem,) = check_feasible(parse_faults("kill-node,kill-node"), nodes=2, nproc_per_node=1, etcd_members=1)
    assert "fault 2 (kill-node) needs at least 2 nodes" in problem
    assert check_feasible(parse_faults("kill-node,add-node,kill-node"), nodes=2, nproc_per_node=1, etcd_members=1) == []
    assert check_feasible(parse_faults("add-node,kill-node,kill-node"), nodes=2, nproc_per_node=1, etcd_members=1) == []


def test_feasibility_of_targets_and_etcd() -> None:
    assert "group rank 2 does not exist" in check_feasible(parse_faults("kill-node@2"), nodes=2, nproc_per_node=1,
                                                           etcd_members=1)[0]
    assert "global rank 4 does not exist" in check_feasible(parse_faults("kill-worker@4"), nodes=2, nproc_per_node=2,
                                                            etcd_members=1)[0]
    assert "needs --etcd-members 3" in check_feasible(parse_faults("kill-etcd-member"), nodes=2, nproc_per_node=1,
                                                      etcd_members=1)[0]
    assert check_feasible(parse_faults("kill-etcd-member"), nodes=2, nproc_per_node=1, etcd_members=3) == []
    assert "no quorum" in check_feasible(parse_faults("kill-etcd-member,kill-etcd-member"), nodes=2, nproc_per_node=1,
                                         etcd_members=3)[0]


def test_plan_is_a_function_of_the_seed() -> None:
    assert make_plan(7) == make_plan(7)
    assert len({make_plan(seed) for seed in range(10)}) > 5


def test_plan_puts_faults_in_order_inside_the_job() -> None:
    for seed in range(50):
        faults = make_plan(seed)
        steps = [f.at_step for f in faults]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        assert all(6 <= s <= 58 for s in steps)
        assert [f.kind for f in faults] == [s.kind for s in MIXED]


def test_plan_targets_exist_when_they_fire() -> None:
    for seed in range(50):
        kill_node, kill_worker, hang, corrupt = make_plan(seed)
        assert kill_node.target in (0, 1, 2)
        # one node is gone by then: 2 nodes x 1 worker left
        assert kill_worker.target in (0, 1) and hang.target in (0, 1) and corrupt.target in (0, 1)


def test_corruption_fires_between_checkpoints() -> None:
    for seed in range(50):
        (corrupt,) = make_plan(seed, parse_faults("corrupt-checkpoint"))
        assert 1 <= corrupt.at_step % 5 <= 2


def test_corruption_fires_more_than_a_checkpoint_interval_before_the_end() -> None:
    # The soak's plan (60 steps, a checkpoint every 5): seed 1609 drew step 56, the job had committed its last step
    # (60) by the time its workers were stopped, and no restore followed the damage.
    for seed in range(1600, 1700):
        *_, corrupt = make_plan(seed)
        assert corrupt.at_step <= 60 - 5 - 2, (seed, corrupt)


def test_pinned_targets_are_kept() -> None:
    (f,) = make_plan(3, parse_faults("kill-node@last"))
    assert f.target == "last"


def test_too_many_faults_for_the_steps() -> None:
    with pytest.raises(ValueError, match="use at least --steps"):
        make_plan(0, parse_faults(",".join(["kill-worker"] * 5)), steps=10)


def test_config_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        ChaosConfig(report_dir=tmp_path, script=tmp_path / "missing.py")
    with pytest.raises(ValueError, match="does not divide world size"):
        ChaosConfig(report_dir=tmp_path, nodes=3, global_batch=8)
    with pytest.raises(ValueError, match="unknown placeholder"):
        ChaosConfig(report_dir=tmp_path, script=Path(__file__), script_args=("--dir", "{ckpt}"))
    cfg = ChaosConfig(report_dir=tmp_path, nodes=2, nproc_per_node=2, faults=parse_faults("add-node"))
    assert cfg.max_nodes == 3 and cfg.world_sizes == [2, 4, 6] and cfg.effective_global_batch == 12
    assert cfg.effective_dataset_size == 20 * 12 + 7


def test_custom_script_placeholders(tmp_path: Path) -> None:
    cfg = ChaosConfig(report_dir=tmp_path, script=Path(__file__), steps=9,
                      script_args=("--ckpt-dir", "{local_dir}/ck", "--steps={steps}", "{node}"))
    argv = cfg.script_argv(local_dir=Path("/l"), shared_dir=Path("/s"), node="node3")
    assert argv == ["--ckpt-dir", "/l/ck", "--steps=9", "node3"]


def test_scenarios_are_valid(tmp_path: Path) -> None:
    for scenario in SCENARIOS.values():
        ChaosConfig(report_dir=tmp_path, **scenario.settings)
    assert SCENARIOS["soak"].runs == 50


@pytest.mark.parametrize("argv,message", [
    (["run", "--faults", "kill-worker,explode"], "unknown fault kind 'explode'"),
    (["run", "--nodes", "1", "--faults", "kill-node"], "needs at least 2 nodes"),
    (["run", "--", "no/such/script.py"], "training script 'no/such/script.py' does not exist"),
    (["run", "--faults", "kill-etcd-member"], "needs --etcd-members 3"),
    (["run", "--"], "must be followed by the training script"),
    (["run", "--runs", "0"], "--runs must be at least 1"),
    # Each of these started etcd and the agents, then failed (or restarted workers until --timeout).
    (["run", "--global-batch", "0"], "--global-batch must be at least 1"),
    (["run", "--faults", "hang-worker", "--hang-timeout", "nan"], "--hang-timeout must be a positive, finite"),
    (["run", "--timeout", "inf"], "--timeout must be a positive, finite"),
    (["run", "--faults", "kill-worker@\u00b2"], "must be a rank number or 'last'"),
    (["run", "--report", "/proc/no/such"], "--report /proc/no/such: cannot make that directory"),
])
def test_cli_bad_input_exits_2_before_starting(argv: list[str], message: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv[:1], "--report", str(tmp_path / "r"), *argv[1:]])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_custom_script_without_ckpt_every_is_warned_about(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Session 50's audit: README's custom-script line gave a false BROKEN (8 steps lost > 5): the script saved
    every 10 steps, its own default, and the harness judged against --ckpt-every 5."""
    from chaos.cli import build_parser, config_from_args

    parser = build_parser()
    args = parser.parse_args(["run", "--report", str(tmp_path / "r")])
    tiny = str(REPO / "examples" / "train_tiny.py")
    config_from_args(args.run_parser, args, [tiny, "--ckpt-dir", "{local_dir}", "--steps", "{steps}"])
    assert "no {ckpt_every}: steps lost are judged against --ckpt-every 5" in capsys.readouterr().err
    config_from_args(args.run_parser, args, [tiny, "--steps", "{steps}", "--ckpt-every", "{ckpt_every}"])
    assert "ckpt_every" not in capsys.readouterr().err


def test_a_signal_ends_the_harness_with_128_plus_its_number() -> None:
    from chaos.cli import _Signalled, interrupted_status

    assert interrupted_status(_Signalled(signal.SIGTERM)) == 143  # was 130, as for Ctrl-C
    assert interrupted_status(_Signalled(signal.SIGHUP)) == 129
    assert interrupted_status(KeyboardInterrupt()) == 130


def test_cli_lists_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["faults"]) == 0
    out = capsys.readouterr().out
    assert all(kind in out for kind in CATALOG)


def test_a_recorded_reference_serves_only_the_same_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from chaos.judge import Reference, job_key, load_reference, save_reference

    config = ChaosConfig(report_dir=tmp_path / "r", steps=20, faults=parse_faults("kill-worker"))
    ref = Reference("ab", 2, {1: 0.5, 2: None}, None, 1.5, ["a note"], job=job_key(config))
    save_reference(ref, tmp_path / "earlier")
    assert load_reference(tmp_path / "earlier", config) == ref
    # Other faults, another seed of the plan: the same fault-free job.
    other_faults = ChaosConfig(report_dir=tmp_path / "r", steps=20, seed=5, faults=parse_faults("kill-node"))
    assert load_reference(tmp_path / "earlier", other_faults) == ref
    with pytest.raises(ValueError, match="another job \\(different ckpt_every, steps\\)"):
        load_reference(tmp_path / "earlier", ChaosConfig(report_dir=tmp_path / "r", steps=24, ckpt_every=4))
    with pytest.raises(SystemExit) as exc:
        main(["run", "--report", str(tmp_path / "r2"), "--reference", str(tmp_path / "none")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--reference {tmp_path / 'none'}: cannot read" in err and "reference.json" in err
    assert not (tmp_path / "r2").exists()
