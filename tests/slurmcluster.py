"""A real single-node SLURM for the tests: munged, slurmctld and slurmd (Debian's slurm-wlm and
munge) started by hand in the foreground, no systemd, every file under one scratch directory.

Nothing outside it is touched but munged's socket directory (munged wants every directory above
its socket open to all, which pytest's are not): a fresh one under /tmp, removed by `stop()`.
slurm.conf lives in the scratch directory and SLURM_CONF points at it.
The executor plugin's inner srun runs with every SLURM_* variable stripped, so `bin/srun` puts
SLURM_CONF back; `bin/sbatch` records each sbatch command line before running the real one.
Put `bin` first on PATH (`Cluster.env()`). `stop()` cancels every job and ends each daemon by PID.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PARTITION = "mossbuild"
BINARIES = ("munged", "slurmd", "slurmctld", "sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, ok, timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {p}\n{p.read_text()[-2000:] if p.exists() else '(none)'}" for p in logs)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")


def write_script(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


@dataclass
class Cluster:
    root: Path
    node: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)
    socket_dir: Path | None = None

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def sbatch_log(self) -> Path:
        return self.root / "sbatch.log"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env["PATH"] = f"{self.root / 'bin'}:{env['PATH']}"
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=timeout)

    def sbatch_lines(self) -> list[str]:
        return self.sbatch_log.read_text().splitlines() if self.sbatch_log.exists() else []

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld still remembers (MinJobAge), as `scontrol show job -o` fields."""
        out = self.run("scontrol", "show", "job", "-o").stdout
        return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.splitlines() if line.startswith("JobId=")]

    def start(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log", "bin"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket_dir = Path(tempfile.mkdtemp(prefix="mossbuild-munge-"))
        self.socket_dir.chmod(0o755)
        sock = self.socket_dir / "munge.socket"
        self.spawn(
            "munged", "--foreground", f"--key-file={key}", f"--socket={sock}", f"--pid-file={r / 'munge' / 'munged.pid'}",
            f"--log-file={r / 'log' / 'munged.log'}", f"--seed-file={r / 'munge' / 'munged.seed'}",
        )  # fmt: skip
        wait_for("munged's socket", sock.exists, 20, [r / "log" / "munged.log"])

        # The node as slurmd sees this machine (CPUs, sockets, memory), with one fake GPU.
        hw = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
        self.node = hw.split()[0].removeprefix("NodeName=")
        (r / "gres.conf").write_text(f"NodeName={self.node} Name=gpu Type=fake File=/dev/null\n")
        self.conf.write_text(
            "\n".join([
                "ClusterName=mossbuild-test",
                f"SlurmctldHost={self.node}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={sock}",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"StateSaveLocation={r / 'state'}",
                f"SlurmdSpoolDir={r / 'spool'}",
                f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                f"SlurmdPidFile={r / 'slurmd.pid'}",
                f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                # no cgroups on this machine
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core_Memory",
                "MpiDefault=none",
                "ReturnToService=2",
                "MinJobAge=3600",  # finished jobs stay visible: to squeue status checks (>= 120), to the test
                "GresTypes=gpu",
                f"{hw} NodeAddr=127.0.0.1 Gres=gpu:fake:1 State=UNKNOWN",
                f"PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            ]) + "\n"
        )  # fmt: skip
        write_script(r / "bin" / "srun", f'export SLURM_CONF={shlex.quote(str(self.conf))}\nexec {shutil.which("srun")} "$@"\n')
        write_script(
            r / "bin" / "sbatch",
            f"{{ printf sbatch; printf ' %q' \"$@\"; echo; }} >> {shlex.quote(str(self.sbatch_log))}\n"
            f'exec {shutil.which("sbatch")} "$@"\n',
        )

        logs = [r / "log" / "slurmctld.log", r / "log" / "slurmd.log"]
        self.spawn("slurmctld", "-D", "-c", "-f", str(self.conf))
        self.spawn("slurmd", "-D", "-f", str(self.conf), "-N", self.node)
        wait_for("the node to register", lambda: self.node_state() != "", 60, logs)
        if self.node_state() not in ("idle", "mixed", "allocated"):
            self.run("scontrol", "update", f"nodename={self.node}", "state=resume")
        wait_for("the node to be idle", lambda: self.node_state() == "idle", 60, logs)

    def spawn(self, *cmd: str) -> None:
        log = (self.root / "log" / f"{cmd[0]}.out").open("ab")
        self.procs.append(subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT))
        time.sleep(0.5)
        if self.procs[-1].poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited at once ({self.procs[-1].returncode}): see {log.name}")

    def node_state(self) -> str:
        try:
            r = self.run("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", timeout=10)
        except subprocess.TimeoutExpired:
            return ""
        return r.stdout.strip().rstrip("*~#") if r.returncode == 0 else ""

    def stop(self) -> None:
        """Cancel every job, then end the daemons (last started first) by PID."""
        if any(p.poll() is None for p in self.procs[1:]):
            try:
                self.run("scancel", "--full", "--user=root", timeout=10)
                wait_for("jobs to end", lambda: not self.run("squeue", "-h", timeout=10).stdout.strip(), 30, [])
            except (subprocess.TimeoutExpired, RuntimeError):
                pass
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
