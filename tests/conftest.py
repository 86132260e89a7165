"""Suite-wide fixtures: the backend parameter, the rule that no test leaves a process behind,
and the ranks' fault controls each backend supplies."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests import helpers

# A shell that runs the suite as a background job (`cmd &`) starts it with SIGINT ignored,
# which every process it starts would inherit: the Ctrl-C tests need Python's own handling.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Adding a backend to the contract and fault suites is adding its name here (and, if it
# needs a cluster, starting it in the backend fixture below). PHALANX_TEST_BACKENDS=local
# (scripts/test --fast) runs them on those only.
ALL_BACKENDS = ["local", "ray", "cluster"]
BACKENDS = [b for b in os.environ.get("PHALANX_TEST_BACKENDS", ",".join(ALL_BACKENDS))
            .split(",") if b in ALL_BACKENDS]

_REAP_GRACE = 3.0  # seconds for processes that are already exiting to be reaped


# scripts/test runs the suite on two xdist workers (``--dist loadgroup``); each worker
# starts the clusters it needs. Everything that touches Ray goes to one of them: two Ray
# clusters at once would double the suite's largest cost, and some tests count the
# machine's Ray daemons. Everything on the real Slurm goes to one too (one cluster per
# machine); the rest goes by module, so that a module's groups start once.
_ONE_WORKER_DIRS = {"slurm": "slurm", "browser": "browser"}


def _worker_group(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    module = getattr(getattr(item, "module", None), "__name__", item.nodeid)
    if (callspec is not None and callspec.params.get("backend") == "ray") \
            or "ray_cluster" in getattr(item, "fixturenames", ()) \
            or "ray" in module.rsplit(".", 1)[-1] \
            or "_ray_" in item.name:
        return "ray"
    parts = module.split(".")
    return _ONE_WORKER_DIRS.get(parts[1] if len(parts) > 2 else "", module)


def _loadgroup(config: pytest.Config) -> bool:
    """Whether the run sends tests to xdist workers by group. The controller's ``--dist``
    decides; a worker reads ``dist`` as "no" (xdist resets it there) and the controller's
    choice as ``loadgroup`` -- and it is the workers' collection that names the groups."""
    return (config.getoption("dist", "no") == "loadgroup"
            or bool(getattr(config.option, "loadgroup", False)))


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(config, items):
    """Each test's group as an ``xdist_group`` mark, before xdist's own hook reads the
    marks (on each worker) and makes them part of the test ids the controller schedules by
    (``id@group``); after it, that suffix where xdist's could not set it."""
    grouping = _loadgroup(config)
    if grouping:
        for item in items:
            item.add_marker(pytest.mark.xdist_group(_worker_group(item)))
    yield
    if grouping:
        for item in items:
            _suffix_group(item)


def _suffix_group(item: pytest.Item) -> None:
    """``@group`` on the item's id where xdist's hook left it off: xdist (3.8) writes the
    id's old attribute (``_nodeid``), which pytest 9.2 no longer reads -- its ids are
    structured (``_id``) -- so every test was scheduled alone and the groups did nothing
    (pytest-dev/pytest-xdist#1386). Nothing to do where xdist's suffix took."""
    names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                    for mark in item.iter_markers("xdist_group")})
    suffix = "@" + "_".join(names)
    node_id = getattr(item, "_id", None)
    if not names or item.nodeid.endswith(suffix) or node_id is None:
        return
    item._id = type(node_id).parse(item.nodeid + suffix)  # pytest's own, see above


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    """The backend's name, or for the cluster backend a configured ``ClusterBackend``."""
    if request.param == "ray":
        pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'phalanx[ray]')")
        request.getfixturevalue("ray_cluster")
    if request.param == "cluster":
        # PHALANX_TEST_CLUSTER_TREE=1: the three agents as a tree (node 1 below node 0)
        tree = {"tree_threshold": 1, "fanout": 2} if os.environ.get(
            "PHALANX_TEST_CLUSTER_TREE") else {}
        return request.getfixturevalue("agent_cluster").backend(**tree)
    return request.param


@pytest.fixture(scope="session")
def agent_cluster():
    """Three ``phalanx agent`` daemons on 127.0.0.2-4, for every test of the cluster
    backend; each test module checks that it left nothing running under them."""
    from tests import agentcluster

    agents = agentcluster.start()
    helpers.CLUSTER_ROOTS.update(proc.pid for proc in agents.procs)
    try:
        yield agents
    finally:
        helpers.CLUSTER_ROOTS.difference_update(proc.pid for proc in agents.procs)
        agentcluster.stop(agents)


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray test cluster for the whole run (three nodes on this machine), shared by every
    test of the ray backend; each test module checks that it left no actor behind. Without
    Ray, every test that asks for it skips, saying so."""
    pytest.importorskip("ray", reason="this test needs a Ray cluster (pip install 'phalanx[ray]')")
    from tests import raycluster

    cluster = raycluster.start()
    try:
        yield cluster
    finally:
        raycluster.stop(cluster)


@pytest.fixture
def ranks(backend):
    """Kill, stop and signal ranks the way the backend under test can: through the group's
    own signal path (the backend's channel), never ``os.kill`` on a pid that may live on
    another machine. ``reports_signal``: whether the backend learns the signal a rank died
    of (a local child's exit status does; Ray reports a death, not its signal)."""
    return helpers.RankControl(reports_signal=getattr(backend, "name", backend) in
                               ("local", "cluster"))


@pytest.fixture
def make_group(backend):
    """Start groups on the backend under test; each is shut down when the test ends."""
    from phalanx import WorkerGroup

    groups: list = []

    def make(target, *args, **kwargs):
        kwargs.setdefault("backend", backend)
        kwargs.setdefault("echo_output", False)
        group = WorkerGroup(target, *args, **kwargs)
        groups.append(group)
        return group

    yield make
    for group in groups:
        group.shutdown(timeout=2)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline())}"
    except psutil.Error:
        return f"pid {proc.pid}: <gone>"


def _check_no_leftovers(what: str) -> None:
    if helpers.wait_until(lambda: not helpers.stray_children(), _REAP_GRACE, interval=0.05):
        return
    leftovers = helpers.stray_children()
    if not leftovers:
        return
    described = [_describe(p) for p in leftovers]
    for proc in leftovers:
        helpers.kill_quietly(proc.pid, signal.SIGKILL)
    psutil.wait_procs(leftovers, timeout=3)
    pytest.fail(
        f"{what} left {len(described)} child process(es) alive:\n  " + "\n  ".join(described),
        pytrace=False,
    )


@pytest.fixture(autouse=True)
def no_leftover_processes(request):
    """Every test must end with no child process of the test process left alive."""
    yield
    _check_no_leftovers(f"test {request.node.nodeid}")


@pytest.fixture(scope="module", autouse=True)
def no_leftover_processes_per_module(request):
    """Module-scoped groups must not leave processes behind either once torn down (nor,
    on Ray, actors or placement groups)."""
    yield
    _check_no_leftovers(f"module {request.module.__name__}")
    from tests import agentcluster

    if agentcluster.running is not None:
        left = agentcluster.leftovers(agentcluster.running)
        if left:
            pytest.fail(f"module {request.module.__name__} left under the agents: {left}",
                        pytrace=False)
    if _ray_running():  # only the ray_cluster fixture connects this process to Ray
        from tests import raycluster

        try:
            leaked = raycluster.leftovers()
        except raycluster.RayUnresponsive as exc:  # bounded: a dead Ray ends the check
            pytest.fail(f"module {request.module.__name__}: {exc}", pytrace=False)
        if leaked:
            raycluster.clean()
            pytest.fail(f"module {request.module.__name__} left on Ray: {leaked}", pytrace=False)


def _ray_running() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True, scope="session")
def _quiet_progress_bar():
    # The progress bar is drawn only on a terminal; keep test output stable either way.
    old = os.environ.get("PHALANX_PROGRESS")
    os.environ["PHALANX_PROGRESS"] = "0"
    yield
    if old is None:
        os.environ.pop("PHALANX_PROGRESS", None)
    else:
        os.environ["PHALANX_PROGRESS"] = old


@pytest.fixture
def tracked():
    """Processes the test must see gone (tests/trees.py); what is left is SIGKILLed."""
    from tests.trees import Tracked

    tracked = Tracked()
    try:
        yield tracked
    finally:
        tracked.kill_all()
