"""Worker-side framework bootstrap: what runs in a worker before the user object is built
and when the worker exits, as named by the :class:`~phalanx.world.frameworks.Framework` records.

Everything here runs inside the worker process. Frameworks are imported only when their
framework was asked for, and cleanups only touch a framework the user code imported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from phalanx.world.frameworks import ENV_NODE_SERVICE, Framework, NodeService

logger = logging.getLogger(__name__)

SERVICE_START_TIMEOUT = 120.0  # seconds for a node service (a Ray node) to come up
SERVICE_STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when stopping it

# Runs the service with PR_SET_PDEATHSIG = SIGTERM (kept across exec): should the worker be
# killed, the service is told to stop too instead of outliving it. The parent check closes
# the window in which the worker died before the signal was armed.
_PDEATHSIG_EXEC = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
_OUTPUT_LIMIT = 1 << 20  # bytes of a service's output read back at most


# -- hooks named by frameworks.FRAMEWORKS ---------------------------------------------------


def jax_setup() -> None:
    """Teach ``jax.distributed.initialize()`` (no arguments) to read phalanx's variables.

    This uses jax's cluster-detection hook (``jax._src.clusters.ClusterEnv``, private): if
    a jax release moves it, the rank still starts, with a warning, and
    ``initialize()`` then needs the ``JAX_*`` values passed explicitly.
    """
    try:
        _register_jax_cluster()
    except (ImportError, AttributeError, ValueError) as exc:
        logger.warning("cannot register phalanx with jax.distributed (%s: %s); pass "
                       "coordinator_address, num_processes and process_id to initialize()",
                       type(exc).__name__, exc)


def _register_jax_cluster() -> None:
    from jax._src import clusters

    class PhalanxCluster(clusters.ClusterEnv):  # type: ignore[no-untyped-call]  # jax's hook
        name = "phalanx"

        @classmethod
        def is_env_present(cls) -> bool:
            return "JAX_PROCESS_ID" in os.environ and "JAX_NUM_PROCESSES" in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs: int | None,
                                    override_coordinator_port: str | None = None) -> str:
            return os.environ["JAX_COORDINATOR_ADDRESS"]

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ["JAX_NUM_PROCESSES"])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ["JAX_PROCESS_ID"])

    # Checked before the cluster managers jax knows (SLURM, Kubernetes, ...): the variables
    # phalanx set for this rank are the ones that describe it. jax keeps its detectors, in
    # the order it tries them, in a private list: no public way ranks one first (a release
    # without it is handled in jax_setup).
    registry = clusters.ClusterEnv._cluster_types  # noqa: SLF001 - see above
    registry.remove(PhalanxCluster)
    registry.insert(0, PhalanxCluster)


def torch_cleanup() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def tensorflow_cleanup() -> None:
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        tf.keras.backend.clear_session()


def ray_cleanup() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


_HOOKS: dict[str, Callable[[], None]] = {
    "jax_setup": jax_setup,
    "torch_cleanup": torch_cleanup,
    "tensorflow_cleanup": tensorflow_cleanup,
    "ray_cleanup": ray_cleanup,
}


# -- node services ------------------------------------------------------------------------


def _accepts(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=0.5):
            return True
    except OSError:
        return False


def _executable(name: str) -> str:
    """``name`` on PATH, else beside this interpreter (a virtualenv that is not activated);
    ``python`` is this interpreter."""
    if name == "python":
        return sys.executable
    found = shutil.which(name)
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.access(beside, os.X_OK) else name


class RunningService:
    """A node service started by this worker; :meth:`stop` ends it and what it started."""

    def __init__(self, spec: NodeService, timeout: float = SERVICE_START_TIMEOUT) -> None:
        self.spec = spec
        deadline = time.monotonic() + timeout
        after = spec.after
        if after is not None:
            self._wait(lambda: _accepts(after), deadline,
                       f"{after[0]}:{after[1]} to accept connections")
        # Its output goes to an unlinked temporary file: nothing is left behind, however the
        # worker ends.
        self._out_fd, path = tempfile.mkstemp(prefix="phalanx-service-", suffix=".log")
        os.unlink(path)
        command = [_executable(spec.command[0]), *spec.command[1:]]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PDEATHSIG_EXEC, str(os.getpid()), *command],
            stdin=subprocess.DEVNULL,
            stdout=self._out_fd,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
        )
        try:
            self._wait(self._ready, deadline, f"{spec.command[0]} to start")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{' '.join(self.spec.command)} exited with code {self.proc.returncode}:\n"
                + self.output_tail()
            )
        if self.spec.ready_line is not None:
            return self.spec.ready_line in self.output()
        if self.spec.ready_port is not None:
            return _accepts(self.spec.ready_port)
        return True

    def _wait(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gave up waiting for {what}:\n{self.output_tail()}")
            time.sleep(0.1)

    def output(self) -> str:
        """What the service wrote so far (its last megabyte)."""
        fd = getattr(self, "_out_fd", None)
        if fd is None:
            return ""
        try:
            size = os.fstat(fd).st_size
            data = os.pread(fd, _OUTPUT_LIMIT, max(0, size - _OUTPUT_LIMIT))
        except OSError:
            return ""
        return data.decode("utf-8", errors="replace")

    def output_tail(self, lines: int = 20) -> str:
        return "".join(self.output().splitlines(keepends=True)[-lines:])

    def stop(self, grace: float = SERVICE_STOP_GRACE) -> None:
        """SIGTERM, wait up to ``grace``, then SIGKILL it and every process it started."""
        import psutil  # type: ignore[import-untyped]  # no stubs: types-psutil is not a dependency

        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            family = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        for process in family:
            with contextlib.suppress(psutil.Error):
                process.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        with contextlib.suppress(OSError):
            os.close(self._out_fd)
        if self.spec.scratch is not None:
            shutil.rmtree(self.spec.scratch, ignore_errors=True)


# -- entry points used by the worker ------------------------------------------------------


class Bootstrap:
    """The framework state of one worker: started by :meth:`setup`, ended by :meth:`cleanup`."""

    def __init__(self, framework: Framework) -> None:
        self.framework = framework
        self.service: RunningService | None = None

    def setup(self) -> None:
        spec = os.environ.pop(ENV_NODE_SERVICE, None)
        if spec is not None:
            self.service = RunningService(NodeService.from_json(spec))
        if self.framework.setup is not None:
            _HOOKS[self.framework.setup]()

    def cleanup(self) -> None:
        """Best effort, never raises: the worker is exiting."""
        if self.framework.cleanup is not None:
            try:
                _HOOKS[self.framework.cleanup]()
            except Exception:
                logger.exception("%s cleanup failed", self.framework.name)
        if self.service is not None:
            self.service.stop()
            self.service = None
