"""`python -m serving.launch`: a multi-process run on one machine, for experiments and tests.

    python -m serving.launch --num_processes=2 --devices_per_process=2 -- \\
        python -m serving.server --tensor_parallel_size=4 --port 8000
    python -m serving.launch --num_processes=2 --devices_per_process=4 -- python my_script.py

Runs COMMAND as `--num_processes` processes with `--devices_per_process` CPU
devices each and the settings `serving.cluster.distributed.initialize` reads
(`RIDGELINE_COORDINATOR_ADDRESS` on a free loopback port,
`RIDGELINE_NUM_PROCESSES`, `RIDGELINE_PROCESS_ID`) in their environment.
Their output (stdout and stderr) comes out line by line prefixed `[p0] `,
`[p1] `, .... The launcher exits with the first non-zero exit code a process
ends with (128 + N for a process killed by signal N), after stopping the
others; with 0 when all end with 0. Ctrl-C (or SIGTERM) stops them all: each
gets SIGINT (a server's process 0 then shuts the run down cleanly; SIGTERM
would be taken by JAX's preemption notifier), and SIGKILL `--grace_s` seconds
later if it is still there.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from serving.cluster import distributed

INTERRUPTED_EXIT_CODE = 130


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_env(process_id: int, num_processes: int, coordinator_address: str, devices_per_process: int,
                base: Optional[dict] = None) -> dict:
    """The environment of process `process_id`: distributed settings plus a CPU backend with
    `devices_per_process` devices (any device-count flag already in XLA_FLAGS is replaced)."""
    env = dict(os.environ if base is None else base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env[distributed.ENV_COORDINATOR] = coordinator_address
    env[distributed.ENV_NUM_PROCESSES] = str(num_processes)
    env[distributed.ENV_PROCESS_ID] = str(process_id)
    return env


def exit_code(returncode: int) -> int:
    """Popen's return code as a shell would report it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


class Launch:
    """N child processes whose output is forwarded with a prefix, stopped together."""

    def __init__(self, command: Sequence[str], num_processes: int, devices_per_process: int,
                 coordinator_address: Optional[str] = None, grace_s: float = 5.0, out=None):
        if num_processes < 1 or devices_per_process < 1:
            raise ValueError("--num_processes and --devices_per_process must be >= 1")
        if not command:
            raise ValueError("no command to run (put it after --)")
        self.command = list(command)
        self.num_processes = num_processes
        self.devices_per_process = devices_per_process
        self.coordinator_address = coordinator_address or f"127.0.0.1:{free_port()}"
        self.grace_s = grace_s
        self.out = out or sys.stdout
        self._out_lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self._interrupted = False  # set by SIGINT / SIGTERM while `run` waits
        self._readers: list[threading.Thread] = []

    def _forward(self, i: int, stream) -> None:
        prefix = f"[p{i}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._out_lock:
                self.out.write(prefix + line + "\n")
                self.out.flush()
        stream.close()

    def start(self) -> None:
        for i in range(self.num_processes):
            env = process_env(i, self.num_processes, self.coordinator_address, self.devices_per_process)
            # Own session: a terminal's Ctrl-C reaches the launcher only, which stops the children itself.
            p = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            self.procs.append(p)
            t = threading.Thread(target=self._forward, args=(i, p.stdout), daemon=True)
            t.start()
            self._readers.append(t)

    def stop(self) -> None:
        """SIGINT to every child still running, SIGKILL to those left after the grace period."""
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGINT)
        deadline = time.monotonic() + self.grace_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for t in self._readers:
            t.join(timeout=5)

    def wait(self) -> int | None:
        """Until every child has ended with 0 (-> 0) or one ended otherwise (-> its code, others stopped),
        or the launcher was interrupted (-> None, children untouched)."""
        while True:
            if self._interrupted:
                return None
            running = False
            for p in self.procs:
                rc = p.poll()
                if rc is None:
                    running = True
                elif rc != 0:
                    self.stop()
                    return exit_code(rc)
            if not running:
                for t in self._readers:
                    t.join(timeout=5)
                return 0
            time.sleep(0.05)

    def run(self) -> int:
        # Ctrl-C and SIGTERM only set a flag that `wait` polls. Not KeyboardInterrupt: raised
        # asynchronously inside Popen.poll it can leave the Popen's wait lock held, and the
        # launcher then hung in the next wait() instead of stopping its children.
        previous = {sig: signal.signal(sig, self._interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            rc = self.wait()
            if rc is not None:
                return rc
            self.stop()
            failed = [exit_code(p.returncode) for p in self.procs if p.returncode not in (None, 0)
                      and p.returncode not in (-signal.SIGINT, -signal.SIGKILL)]
            return failed[0] if failed else INTERRUPTED_EXIT_CODE
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if any(p.poll() is None for p in self.procs):
                self.stop()

    def _interrupt(self, signum, frame) -> None:
        self._interrupted = True


def _signal_group(p: subprocess.Popen, sig) -> None:
    try:
        os.killpg(p.pid, sig)  # the child leads its own session: this reaches what it started too
    except (ProcessLookupError, PermissionError):
        pass


def parse_args(argv: Sequence[str]):
    argv = list(argv)
    if "--" in argv:
        at = argv.index("--")
        own, command = argv[:at], argv[at + 1:]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(prog="python -m serving.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_processes", type=int, required=True, help="processes to start")
    parser.add_argument("--devices_per_process", type=int, default=1, help="CPU devices of each process")
    parser.add_argument("--coordinator_address", default=None,
                        help="host:port of process 0's coordination service (default: a free loopback port)")
    parser.add_argument("--grace_s", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(own)
    if not command:
        parser.error("no command: put it after --, e.g. -- python -m serving.server ...")
    return args, command


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    launch = Launch(command, args.num_processes, args.devices_per_process, args.coordinator_address, args.grace_s)
    return launch.run()


if __name__ == "__main__":
    sys.exit(main())
