"""elastic/peer_loss.py's hook in a real interpreter: a KeyboardInterrupt (elastic-run forwards a Ctrl-C to its
workers) is one line, and the process still ends as killed by SIGINT; without the agent's variable, as before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic.peer_loss import ENV_GRACE

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import os, time
    from elastic import peer_loss
    peer_loss.install()
    def train():  # READY and the sleep on one line: wherever the SIGINT lands after READY, it is this line
        os.write(1, b"READY\\n"); time.sleep(60)
    train()
    """
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("under_agent", [True, False], ids=["under-elastic-run", "plain"])
def test_a_forwarded_sigint_is_one_line_and_still_a_sigint_exit(tmp_path: Path, under_agent: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in (ENV_GRACE, "LOGLEVEL")}
    env.update(PYTHONPATH=str(REPO), RANK="3", **({ENV_GRACE: "5"} if under_agent else {}))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "READY\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGINT, err
    if under_agent:
        assert err == "elastic: rank 3: stopped by SIGINT in train.py:6\n"
    else:
        assert "Traceback" in err and "KeyboardInterrupt" in err
