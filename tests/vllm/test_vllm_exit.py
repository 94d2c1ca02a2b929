"""A process whose vLLM engine is still up when it ends exits (the engine core is a non-daemon child: with it up,
multiprocessing's exit handler waited for it forever, and ``campaign run`` printed its result and never
returned). The script below keeps its backend to the end, and registers ``weakref.finalize``'s exit hook before
multiprocessing is imported, as the CLI's imports do (vLLM's own cleanup then comes after that wait)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support import REPO_ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import weakref

    class Early:
        pass

    EARLY = Early()
    weakref.finalize(EARLY, lambda: None)  # before multiprocessing is imported, as the CLI's imports do
    KEEP = []

    def main(model):
        import time

        from campaign_orchestrator.generation.engines.vllm_engine import VLLMEngine
        from campaign_orchestrator.generation.requests import GenRequest, Sampling

        b = VLLMEngine(model=model, top_k=2)
        KEEP.append(b)  # held to the end
        out = []
        b.run([GenRequest("k", "ab=cd ef =", 0, 0, None)], Sampling(max_new_tokens=4), lambda r, c: out.append(c))
        assert out[0].ok, out[0].error
        print("ENDING", time.time(), flush=True)

    if __name__ == "__main__":
        import sys

        main(sys.argv[1])
    """
)


def test_a_process_ending_with_its_vllm_engine_up_exits(demo_models, tmp_path):
    script = tmp_path / "keep_engine.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen(
        [sys.executable, str(script), str(demo_models["teacher"])],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the script and the engine processes it started
        out, _ = p.communicate()
        pytest.fail(f"the process did not exit:\n{out[-3000:]}")
    exited = time.time()
    assert p.returncode == 0, out[-3000:]
    ending = float(next(line for line in out.splitlines() if line.startswith("ENDING")).split()[1])
    assert exited - ending < 120, exited - ending  # it stopped its engine and left (a hang never returns)
