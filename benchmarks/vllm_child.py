"""vLLM in a child process of its own environment, for side-by-side benchmarks.

The child runs a script (text) with a JSON spec file as its argument; it prints a line
``VLLM_READY <json>`` once loaded, then answers each command line on its stdin with one
``VLLM_RESULT <json>`` line, until a line it does not know. Its log goes to a file (a pipe
nobody reads would fill). vLLM is never a dependency of pagedllm.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path


def vllm_env() -> dict[str, str]:
    """This process's environment with vLLM-CPU given every core: left unset, its OpenMP
    binding ("auto") keeps a core for its front end, and on a 2-core machine runs the model
    on one thread. An explicit setting is kept."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    return env


class VllmChild:
    """``VllmChild(python, script, spec)``: started and loaded (in ``vllm_env()``);
    ``ask(command) -> dict``."""

    def __init__(self, python: str, script: str, spec: dict) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        tmp = Path(self.tmp.name)
        (tmp / "spec.json").write_text(json.dumps(spec))
        (tmp / "run_vllm.py").write_text(script)
        self.log = open(tmp / "log.txt", "w+")  # noqa: SIM115 (closed by close())
        self.env = vllm_env()
        self.proc = subprocess.Popen(
            [python, str(tmp / "run_vllm.py"), str(tmp / "spec.json")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=self.env,
        )
        try:
            self.ready = self._reply("VLLM_READY ")
        except RuntimeError:
            self.close()  # nobody else holds the child yet
            raise

    def ask(self, command: str) -> dict:
        """Send one command line; the child's VLLM_RESULT as a dict."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._reply("VLLM_RESULT ")

    def _reply(self, prefix: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return json.loads(line.removeprefix(prefix))
        self.proc.wait()
        self.log.seek(0)
        tail = self.log.read()[-3000:]
        raise RuntimeError(f"vLLM run failed (exit {self.proc.returncode}): {tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.tmp.cleanup()
