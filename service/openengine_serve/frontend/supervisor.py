"""Frontend entry point: checks the gRPC server dependency first, then runs one worker or supervises several.

With W > 1 workers, W processes bind the same public port (grpc.so_reuseport)
and the kernel spreads connections over them. The supervisor restarts a worker
that dies, forwards SIGTERM/SIGINT to all of them (each drains on its own), and
exits non-zero when a worker cannot start. It also serves the metrics port,
aggregating every worker through prometheus_client's multiprocess mode.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from ..common.config import FrontendConfig, env_name
from ..common.grpc_server import resolve_implementation
from ..common.lifecycle import logger, run_component, start_metrics
from ..common.logging_setup import log_event, setup_logging
from ..common.tls import check_public_tls
from .auth import check_key_transport, parse_keys, warn_if_open
from .ready_file import READY_FILE_VARIABLE

RESTART_BACKOFF_S = 1.0
# How many workers share this process's CPU budget (set by the supervisor for its workers).
WORKERS_SHARING_VARIABLE = "OPENENGINE_WORKERS_SHARING_CPUS"


def run_frontend(config: FrontendConfig) -> int:
    # Before anything heavy (tokenizer, coordinator, binding): fails with the install command.
    implementation = resolve_implementation(
        config.grpc_server, config.native_io_threads, sharing=int(os.environ.get(WORKERS_SHARING_VARIABLE, "1"))
    )
    check_security(config)  # security hook: TLS files, the native+TLS conflict, the API key file
    if config.workers == 1:
        from .server import serve

        def main(stop):
            start_metrics(config.metrics_port, host=config.metrics_bind_host())
            if READY_FILE_VARIABLE not in os.environ:  # else a supervisor's worker: the supervisor warned
                warn_if_open(config)
            return serve(config, implementation, stop)

        return run_component(config, main)
    return Supervisor(config).run()


def check_security(config: FrontendConfig) -> None:
    """ConfigError (exit 2) at start for TLS or key settings that cannot work."""
    check_public_tls(config, config.grpc_server)
    if config.api_keys_file:
        parse_keys(config.api_keys_file)
        check_key_transport(config)


class Supervisor:
    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.base_id = config.frontend_id or f"frontend-{socket.gethostname()}-{os.getpid()}"
        self.stopping = False
        self.procs: dict[int, subprocess.Popen] = {}
        self.state_dir = ""

    def worker_command(self, index: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "openengine_serve",
            "frontend",
            "--workers",
            "1",
            "--metrics-port",
            "0",
            "--frontend-id",
            f"{self.base_id}-w{index}",
        ]

    def ready_file(self, index: int) -> str:
        return os.path.join(self.state_dir, f"worker-{index}.ready")

    def start_worker(self, index: int, env: dict[str, str]) -> None:
        if os.path.exists(self.ready_file(index)):
            os.remove(self.ready_file(index))
        self.procs[index] = subprocess.Popen(
            self.worker_command(index), env={**env, READY_FILE_VARIABLE: self.ready_file(index)}
        )
        log_event(logger, "frontend worker started", worker=index, pid=self.procs[index].pid)

    def run(self) -> int:
        setup_logging("frontend-supervisor", self.config.log_level)
        self.state_dir = tempfile.mkdtemp(prefix="openengine-frontend-")
        metrics_dir = os.path.join(self.state_dir, "metrics")
        os.mkdir(metrics_dir)
        env = dict(
            os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir, **{WORKERS_SHARING_VARIABLE: str(self.config.workers)}
        )
        # Workers take every other setting from the same flags and environment as the supervisor.
        for f in dataclasses.fields(self.config):
            if f.name not in ("workers", "metrics_port", "frontend_id"):
                env[env_name(f)] = str(getattr(self.config, f.name))
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        from prometheus_client import CollectorRegistry, multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        start_metrics(self.config.metrics_port, registry, host=self.config.metrics_bind_host())
        warn_if_open(self.config)

        def on_signal(signum, _frame):
            self.stopping = True
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signum)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        for index in range(self.config.workers):
            self.start_worker(index, env)
        exit_code = 0
        try:
            while True:
                time.sleep(0.2)
                alive = [i for i, p in self.procs.items() if p.poll() is None]
                if self.stopping:
                    if not alive:
                        break
                    continue
                for index, proc in list(self.procs.items()):
                    if proc.poll() is None:
                        continue
                    if not os.path.exists(self.ready_file(index)):
                        log_event(logger, "frontend worker could not start", worker=index, code=proc.returncode)
                        exit_code = 1
                        on_signal(signal.SIGTERM, None)
                        break
                    log_event(logger, "frontend worker died; restarting", worker=index, code=proc.returncode)
                    multiprocess.mark_process_dead(proc.pid)
                    time.sleep(RESTART_BACKOFF_S)
                    self.start_worker(index, env)
        finally:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        return exit_code
