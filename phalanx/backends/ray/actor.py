"""The node side of the Ray backend: what runs inside each rank's Ray actor.

On the direct transport the rank runs *in its actor's worker process*, on the actor's main
thread, as a user's plain Ray actor would: :class:`RankActor` is a sync actor with
``max_concurrency=1`` and no concurrency groups (with either, Ray runs methods on another
thread, and ``signal.signal`` in user code would fail). So Ray inside a rank is Ray inside
an actor: ``ray.is_initialized()``, the actor's id, its node, the controller's job,
``ray.get_gpu_ids()`` (the bundle's GPUs, as ``CUDA_VISIBLE_DEVICES`` says),
``get_current_placement_group()`` (the group's), and ``ray.ObjectRef`` handles travelling
in a call's arguments (:func:`share_ray_refs`: phalanx's pickling uses Ray's own reducer for them).

The controller makes each rank's actor when the rank launches, having left its
:class:`ActorStart` in Ray's key-value store under the actor's name (not as an argument:
Ray deserializes arguments with its serialization context, whose making costs every
actor ~50 ms of CPU as it starts), and the actor's constructor takes it and starts the
rank, on the main thread, with no second Ray call to wait for (an actor made earlier --
the first of a node on another machine, asked for the node's free ports -- does the same
when its ``serve`` call comes, given the start):

1. it connects four streams back to the controller -- stdout, stderr, control, side -- at
   once, each proving the group's secret (:mod:`phalanx.wire.handshake`): over TCP, or
   over a Unix socket when the controller runs on the same machine as the same user
   (which then hands over a pair of pipes for the control stream);
2. starts the rank's warden (:mod:`phalanx.node.warden`, fork and exec), which holds the
   side stream: signals, stacks and stops reach the rank through it while user code runs,
   and it ends whatever the actor started if the actor is killed (``ray.kill``, Ray's
   out-of-memory killer), reporting the exit status where it is known;
3. becomes a child subreaper, applies the rank's environment to ``os.environ`` (Ray's own
   ``CUDA_VISIBLE_DEVICES`` for the bundle is kept), changes to its directory, points fds 1
   and 2 at the output streams (across the network, pipes to threads here that seal what
   is written: :mod:`phalanx.backends.ray.sealed`), so everything the rank and its
   subprocesses print reaches the controller's output pump once (Ray's log forwarding
   never sees it);
4. starts the rank (:func:`phalanx.rank.runtime.start_in_actor`): INIT, the user's
   object built, READY. A SIGINT for the rank waits until it serves.

Then :meth:`RankActor.serve`, Ray's one long call to the actor, serves the rank
(:func:`phalanx.rank.runtime.finish`) over the control stream (sealed across the network),
ends what it left behind, restores the actor's output and signals
(:mod:`phalanx.backends.ray.hosting`), and notes the exit status for the warden
(``sys.exit(code)`` in user code: ``code``), which tells the controller; then it waits
for the controller to end the actor, returning nothing (a result would cost the actor
Ray's serialization context). A death of the actor itself (a signal, ``os._exit``) is
reported by the warden too: the actor notes ``os._exit`` and fatal signals it sends
itself before they take effect.

The relay transport (a controller the nodes cannot connect to) needs concurrent Ray calls
beside ``serve``: ``RelayedRankActor`` (:mod:`phalanx.backends.ray.relay`), a threaded
actor whose rank is a child process under a node supervisor, its streams moved by Ray calls.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from phalanx import config
from phalanx.backends.ray.hosting import HostPatches, Notes, end_leftovers
from phalanx.errors import StartupError
from phalanx.version import __version__
from phalanx.wire import handshake, seal, streams

CONCURRENCY = 1  # the direct RankActor: its methods run on the actor's main thread
_RETRY_DELAY, _RETRY_DELAY_MAX = 0.05, 1.0  # seconds between tries of a cut-short handshake
logger = logging.getLogger(__name__)


# -- python=: the controller side's helpers (the actors run the group's interpreter) -----


def rank_runtime_env(env: Mapping[str, Any] | None, python: str | None) -> dict[str, Any] | None:
    """A rank actor's ``runtime_env``: the user's, ``python=`` as its ``py_executable``."""
    return ({**(env or {}), "py_executable": python} if python is not None
            else None if env is None else dict(env))


def interpreter_path(python: str | None, sys_path: Sequence[str]) -> tuple[str, ...]:
    """With ``python=``: the controller's ``sys_path`` less its own installation's."""
    from phalanx.node.machine import without_own_install

    return tuple(sys_path) if python is None else without_own_install(sys_path)


def replace_idle(ray: Any, bundles: Sequence[Any], python: str | None, *,
                 here: bool = False, timeout: float = 60.0) -> None:
    """Kill the idle actors of ``bundles`` (one node's, made for another interpreter):
    made anew when their ranks launch. One first checks ``python=`` on the node (Ray would
    retry a worker that cannot start): ``here`` (the controller's machine) in this process,
    else asked of an idle actor there. ValueError when it is no interpreter there,
    StartupError when it cannot run a rank (no phalanx, another release)."""
    from phalanx.node.machine import interpreter_problem

    idle = [b for b in bundles if not b.used and b.actor is not None]
    problem = None
    needs = {"ray": ray.__version__}  # a rank's actor runs in it: Ray's worker
    if python is not None and here:
        problem = interpreter_problem(python, __version__, "this machine", needs)
    elif python is not None and idle and hasattr(idle[0].actor, "check_interpreter"):
        problem = ray.get(idle[0].actor.check_interpreter.remote(python, __version__, needs),
                          timeout=timeout)
    if problem is not None:
        kind, why = problem
        raise ValueError(why) if kind == "missing" else StartupError(why)
    for b in idle:
        ray.kill(b.actor, no_restart=True)
        b.used = True


def _open(controller: tuple[str, int, str], timeout: float) -> socket.socket:
    """A connection to the controller's listener: its Unix socket (a path in a directory of
    the controller user's alone) when this actor can reach it -- the same machine, the same
    user --, else TCP."""
    address, port, local_path = controller
    if local_path:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(local_path)
            return sock
        except OSError:  # another machine, another user (or no such socket)
            sock.close()
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError as exc:
        raise ConnectionError(
            f"could not connect back to the controller at {address}:{port} ({exc}); a "
            "controller the cluster cannot reach needs RayBackend(transport='ray')"
        ) from exc
    streams.tune_link(sock)  # no Nagle delay; a link cut without a FIN is noticed
    return sock


def _connect(
    controller: tuple[str, int, str], secret: bytes, hello: handshake.Hello
) -> tuple[socket.socket, seal.FrameAuth]:
    """To the controller, with the keys of the frames that follow the handshake. A
    handshake cut short (the listener closed it unheard while full, or it was reset) is
    tried again, backing off, within ``config.CONNECT_TIMEOUT``; a wrong proof is not."""
    deadline = time.monotonic() + config.CONNECT_TIMEOUT
    delay = _RETRY_DELAY
    while True:
        sock = _open(controller, max(0.1, deadline - time.monotonic()))
        try:
            return sock, handshake.connect(sock, secret, hello,
                                           max(0.1, deadline - time.monotonic()))
        except (handshake.HandshakeIncomplete, OSError):
            sock.close()
            if time.monotonic() + delay >= deadline:
                raise
        except BaseException:
            sock.close()
            raise
        time.sleep(delay)
        delay = min(delay * 2, _RETRY_DELAY_MAX)


def _control_stream(sock: socket.socket) -> tuple[int, ...]:
    """The rank's control stream: over a Unix socket the controller hands over a pair of
    pipes instead (read end, write end), which wake a sleeping reader once per message where
    a socket wakes it twice -- the local backend's speed for ranks on the controller's
    machine. Over TCP, the socket itself."""
    if sock.family != socket.AF_UNIX:
        return (sock.fileno(),)
    _, fds, _, _ = socket.recv_fds(sock, 1, 2)
    if len(fds) != 2:
        raise ConnectionError("the controller did not hand over the rank's pipes")
    return tuple(fds)


def share_ray_refs() -> None:
    """Have phalanx's pickling (cloudpickle, through :mod:`copyreg`) reduce Ray's
    ``ray.ObjectRef`` and ``ActorHandle`` as Ray's own serialization does, with their owner's
    address: a ref passed in a call's arguments (or returned) can be ``ray.get`` where it
    arrives. Ray pins a ref pickled outside its own calls for this process's lifetime (as
    for any ``ray.cloudpickle.dumps`` of one). In a process connected to Ray; once is
    enough, again is harmless. Ray's reducers are taken when the first ref is pickled:
    they come with Ray's serialization context, whose making imports pyarrow (~50 ms of
    CPU, each rank's actor, as it starts) and which a rank that never pickles one never
    needs."""
    import copyreg

    import ray

    for cls in (ray.ObjectRef, ray.actor.ActorHandle):
        if copyreg.dispatch_table.get(cls) is not _ray_reduce:
            copyreg.pickle(cls, _ray_reduce)


def _ray_reduce(obj: Any) -> Any:
    """``obj`` (an ``ObjectRef`` or ``ActorHandle``) reduced by Ray's own reducer for its
    type, registered by Ray's serialization context (made now if it is not yet)."""
    import ray
    from ray import cloudpickle as ray_pickle

    # registers Ray's reducers (Ray has no public name for it)
    ray._private.worker.global_worker.get_serialization_context()  # type: ignore[no-untyped-call]  # noqa: SLF001
    reducer: Any = ray_pickle.CloudPickler.dispatch.get(type(obj))
    if reducer is None:  # not a type Ray reduces (a subclass): as pickle would
        return obj.__reduce_ex__(5)
    return reducer(obj)


class ActorStart(NamedTuple):
    """What a rank's actor needs to start its rank: the controller's listener (address,
    port, the path of its Unix socket), the group's secret, the rank and its incarnation,
    the rank's environment and working directory, and ``own_process`` (see
    :meth:`RankActor.serve`)."""

    controller: tuple[str, int, str]
    secret: bytes
    rank: int
    incarnation: int
    env: Mapping[str, str]
    cwd: str | None
    own_process: bool = False

    def encode(self) -> bytes:
        """As JSON (what :meth:`decode` reads): plain data, nothing for Ray to
        deserialize."""
        address, port, local = self.controller
        return json.dumps({"controller": [address, port, local], "secret": self.secret.hex(),
                           "rank": self.rank, "incarnation": self.incarnation,
                           "env": dict(self.env), "cwd": self.cwd,
                           "own_process": self.own_process}).encode()

    @classmethod
    def decode(cls, data: bytes) -> ActorStart:
        fields = json.loads(data)
        address, port, local = fields["controller"]
        return cls((str(address), int(port), str(local)), bytes.fromhex(fields["secret"]),
                   int(fields["rank"]), int(fields["incarnation"]), dict(fields["env"]),
                   fields["cwd"], bool(fields["own_process"]))


# Where the controller leaves each rank's ActorStart for its actor to take as it starts
# (Ray's internal key-value store, which Ray's actor options and the arguments of its calls
# travel through too): not an argument of the actor's constructor, which Ray would
# deserialize with its serialization context, made there and then -- ~50 ms of CPU in
# every rank's actor (it imports pyarrow), where a rank that never uses Ray's serializer
# needs none of it.
START_STORE = "phalanx"  # the store's namespace
# What the store holds for an actor made ahead of its rank's launch (no argument either:
# an argument is deserialized with Ray's serialization context) until its start replaces
# it: its constructor leaves it there, and serve() takes the start.
AHEAD = b"ahead"


def start_key(job_namespace: str, placement_group: str, actor_name: str) -> bytes:
    """The key of the start of the actor ``actor_name`` in ``placement_group`` (its id, in
    hex), made by a driver of the Ray namespace ``job_namespace``: what the actor can
    tell of itself (the namespace an actor is named in is not among it)."""
    return f"start/{job_namespace}/{placement_group}/{actor_name}".encode()


def put_start(start: ActorStart | bytes, key: bytes, *, replace: bool = False) -> bool:
    """Leave ``start`` (or :data:`AHEAD`) under ``key`` for the actor about to be made
    (``replace``: over what this controller left there); False if another's is there
    (two groups of one driver sharing a placement group and a ``name_prefix``, in two
    namespaces), which is left as it is."""
    from ray.experimental import internal_kv

    data = start if isinstance(start, bytes) else start.encode()
    taken: bool = internal_kv._internal_kv_put(key, data, overwrite=replace,  # noqa: SLF001
                                               namespace=START_STORE)
    return replace or not taken


def drop_starts(keys: Sequence[bytes]) -> None:
    """Remove starts that no actor took (theirs never started)."""
    from ray.experimental import internal_kv

    for key in keys:
        try:
            internal_kv._internal_kv_del(key, namespace=START_STORE)  # noqa: SLF001
        except Exception as exc:  # noqa: BLE001 - Ray going away: its store with it
            logger.debug("could not remove a rank's start from Ray's store: %s", exc)


def _take_start() -> ActorStart:
    """This actor's start (see :func:`_start_or_ahead`), which must be there by now."""
    start = _start_or_ahead()
    if start is None:
        raise StartupError("this rank's actor was made ahead of its launch, and its start "
                           "is not in Ray's store yet")
    return start


def _start_or_ahead() -> ActorStart | None:
    """This actor's start, as the controller left it under its name; removed from the
    store (it holds the group's secret). None where the store says the actor was made
    ahead of its rank's launch (:data:`AHEAD`)."""
    import ray
    from ray.experimental import internal_kv

    context = ray.get_runtime_context()
    name = context.get_actor_name()
    key = start_key(context.namespace, context.get_placement_group_id() or "", name or "")
    data = internal_kv._internal_kv_get(key, namespace=START_STORE)  # noqa: SLF001
    if data == AHEAD:
        return None
    if data is None:
        raise StartupError(f"the start of this rank's actor ({name}) is not in Ray's store: "
                           "its controller is gone, or removed it")
    internal_kv._internal_kv_del(key, namespace=START_STORE)  # noqa: SLF001
    return ActorStart.decode(data)


class RankActor:
    """One rank's place in Ray, on the direct transport: its actor's process runs the rank
    on its main thread (a sync actor: ``max_concurrency=1``, no concurrency groups).

    Made with no argument, the actor takes its :class:`ActorStart` from Ray's store
    (:data:`START_STORE`, under its name) and starts its rank in its constructor: the
    rank connects, builds the user's object and answers READY there, without waiting for
    Ray to deliver a second call; :meth:`serve`, Ray's one long call to the actor, then
    serves it. Given its ``start`` (where the store's key was another's), it starts it
    the same. An actor made ahead of its rank's launch (every actor of a node on another
    machine, whose first is asked for the node's ports) finds :data:`AHEAD` there, or is
    told so (``made_ahead``), and starts its rank in :meth:`serve` instead, from the store
    the same way (or given it). None of these goes through Ray's serializer, except the
    ports' answer and the arguments where a key was another's."""

    def __init__(self, start: ActorStart | None = None, made_ahead: bool = False) -> None:
        # imported now, while the controller places the other actors: the rank's start
        # does not wait for them
        from phalanx.node import proctree, warden  # noqa: F401
        from phalanx.rank import runtime  # noqa: F401
        from phalanx.wire import framing, pickling, protocol  # noqa: F401

        if start is None and not made_ahead:
            start = _start_or_ahead()
        self._rank = None if start is None else _InActor.begin(start)

    def free_ports(self, host: str, count: int) -> list[int]:
        """``count`` distinct ports free on this node now."""
        from phalanx.node.machine import pick_free_ports

        return pick_free_ports(host, count)

    def check_interpreter(self, python: str, version: str,
                          needs: dict[str, str] | None = None) -> tuple[str, str] | None:
        """What keeps ``python`` from running a rank here (``interpreter_problem``)."""
        from phalanx.node.machine import interpreter_problem

        return interpreter_problem(python, version, f"Ray node {socket.gethostname()}",
                                   needs)

    def serve(self, start: ActorStart | None = None) -> None:
        """Serve the rank until it ends, then wait for the controller to end the actor:
        this call returns nothing (raises how the rank's start failed). The rank is the
        one the constructor started, or one started now: given ``start``, or taken from
        Ray's store (an actor made ahead).
        ``own_process``: the rank runs in a child process instead (``python -m
        phalanx.rank.runtime``), for a rank that joins a Ray of its own
        (``framework="ray"``), which a process already connected to this Ray cannot.

        Its end (pid, exit status) reaches the controller from the rank's warden (the
        actor's last note, ``done``) and its control stream, not as this call's result:
        Ray would serialize a result with its serialization context, whose making costs
        ~50 ms of CPU (it imports pyarrow) that a rank which never used Ray's serializer
        would pay for that alone. The controller ends the actor (``ray.kill``) as it stops
        or replaces the rank; a SIGTERM (Ray ending the job) ends the wait too."""
        rank, self._rank = self._rank, None
        if rank is None:  # made ahead: its start given, or left in Ray's store by now
            rank = _InActor.begin(start if start is not None else _take_start())
        rank.finish()
        threading.Event().wait()


def _connect_all(start: ActorStart) -> tuple[list[tuple[socket.socket, seal.FrameAuth]],
                                              tuple[int, ...]]:
    """The rank's four streams to the controller (stdout, stderr, control, side), their
    handshakes at once (a rank's start waits less); and the control stream's fds."""
    roles = (handshake.ROLE_STDOUT, handshake.ROLE_STDERR, handshake.ROLE_CONTROL,
             handshake.ROLE_SIDE)
    made: list[Any] = [None] * len(roles)

    def connect(i: int) -> None:
        try:
            made[i] = _connect(start.controller, start.secret,
                               handshake.Hello(roles[i], start.rank, start.incarnation))
        except BaseException as exc:  # noqa: BLE001 - raised below, on the main thread
            made[i] = exc

    threads = [threading.Thread(target=connect, args=(i,), daemon=True,
                                name="phalanx-connect") for i in range(1, len(roles))]
    for thread in threads:
        thread.start()
    connect(0)
    for thread in threads:
        thread.join()
    connected = [m for m in made if isinstance(m, tuple)]
    try:
        failed = [m for m in made if isinstance(m, BaseException)]
        if failed:
            raise failed[0]
        return connected, _control_stream(connected[2][0])
    except BaseException:
        for sock, _ in connected:
            sock.close()
        raise


class _InActor:
    """One run of a rank in its actor's process: :meth:`begin` connects, sets the process
    up and starts the rank (READY sent); :meth:`finish` serves it, ends what it left
    behind and puts the process back as Ray made it (see the module's docstring)."""

    def __init__(self, connected: list[tuple[socket.socket, seal.FrameAuth]],
                 control: tuple[int, ...], error: BaseException | None = None) -> None:
        self.connected = connected
        self.control = control
        self.local = bool(connected) and connected[0][0].family == socket.AF_UNIX
        self.error = error  # how the start failed: raised by finish()
        self.ended = False
        self.pid: int | None = os.getpid()
        self.code = 1
        self.conn: Any = None
        self.runtime: Any = None
        self.started_code: int | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.saved: tuple[int, int] | None = None
        self.outputs: list[Any] = []
        self.patches: HostPatches | None = None
        self.sigint_held = False  # a SIGINT came between the rank's start and its serving
        self.stack_file: Any = None
        self.notes: Notes | None = None
        self.writer: Any = None
        self._warden: subprocess.Popen[bytes] | None = None

    @classmethod
    def begin(cls, start: ActorStart) -> _InActor:
        """The rank started (or how it failed to, raised by :meth:`finish`); SystemExit
        (Ray ending the worker) propagates."""
        try:
            run = cls(*_connect_all(start))
        except Exception as exc:  # noqa: BLE001 - the serve call's error
            return cls([], (), error=exc)
        run._begin(start.env, start.cwd, start.own_process)
        return run

    def _begin(self, env: Mapping[str, str], cwd: str | None, own_process: bool) -> None:
        from phalanx.node import proctree
        from phalanx.node.stacks import StackFile
        from phalanx.rank import runtime
        from phalanx.wire import framing, streams

        try:
            self.stack_file = StackFile()
            self.notes = notes = self._start_warden(self.stack_file)
            self.patches = HostPatches(notes) if not own_process else None
            self.writer = framing.BacklogWriter("phalanx-worker-writer")
            proctree.become_subreaper()
            rank_env = {name: value for name, value in env.items()  # Ray's GPUs are kept
                        if name != "CUDA_VISIBLE_DEVICES" or name not in os.environ}
            rank_env["PYTHONUNBUFFERED"] = "1"  # the rank's Python subprocesses
            self.saved, self.outputs = self._redirect_output()
            if own_process:
                self._spawn_child(rank_env, cwd, notes)
                return
            os.environ.update(rank_env)
            if cwd:
                try:
                    os.chdir(cwd)
                except OSError as exc:  # the rank's death, told on its stderr
                    print(f"phalanx: the rank cannot start in {cwd}: {exc}", file=sys.stderr,
                          flush=True)
                    self._end()
                    return
            share_ray_refs()  # refs the rank returns keep their owner too
            # imports resolve as in a rank's own interpreter (``python -c``): its working
            # directory first, then PYTHONPATH, then the actor's own path (Ray's)
            front = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(
                os.pathsep))]
            sys.path[:] = list(dict.fromkeys([*front, *sys.path]))
            for fd in self.control:
                os.set_inheritable(fd, False)  # not for the user's subprocesses
            if len(self.control) == 2:
                stream: streams.Stream = streams.PipeStream(*self.control, blocking_reads=True)
                auth = None
                self.connected[2][0].close()
            else:
                sock, auth = self.connected[2]
                sock.setblocking(True)
                stream = streams.SocketStream(sock)
            self.conn = framing.Connection(stream, self.writer, auth=auth)
            # started_code: not None when the rank ended while starting (finish() still
            # sends what it queued, an INIT_ERROR, before the stream closes)
            self.runtime, self.started_code = runtime.start_in_actor(self.conn,
                                                                     self.stack_file.fd)
            # until serve() runs the rank, a SIGINT for it waits (Ray's loop is no place
            # for a KeyboardInterrupt): serve() raises it (_let_sigint_in)
            signal.signal(signal.SIGINT, self._held_sigint)
        except SystemExit:  # Ray's SIGTERM handler: the worker exits as Ray means it to
            self._terminated()
            raise
        except BaseException as exc:  # noqa: BLE001 - the serve call's error
            self.error = exc
            self._end()

    def finish(self) -> dict[str, Any]:
        """Serve the rank until it ends, then end what it left behind; its pid and exit
        status (raises how its start failed)."""
        from phalanx.rank import runtime

        if self.error is not None:
            raise self.error
        try:
            if self.child is not None:
                self.code = self.child.wait()
            elif self.runtime is not None:
                self.code = runtime.finish(self.conn, self.runtime, self.started_code,
                                           in_process=True, first=self._let_sigint_in)
        except SystemExit:  # Ray's SIGTERM handler: the worker exits as Ray means it to
            self._terminated()
            raise
        finally:
            self._end()
        return {"pid": self.pid, "exitcode": self.code}

    def _held_sigint(self, signum: int, frame: Any) -> None:
        self.sigint_held = True

    def _let_sigint_in(self) -> None:
        """As the rank starts serving: SIGINT raises KeyboardInterrupt again, now if one
        came while it waited."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.sigint_held:
            raise KeyboardInterrupt

    def _terminated(self) -> None:
        self.code = -signal.SIGTERM if self.patches is not None and \
            self.patches.terminated else 1
        self._end()

    def _end(self) -> None:
        """End what the rank left behind and put the process back as it was (once)."""
        if self.ended:
            return
        self.ended = True
        import faulthandler

        faulthandler.unregister(config.STACKS_SIGNAL)
        if self.conn is not None:
            self.conn.close()
        elif len(self.control) == 2:
            for fd in self.control:
                os.close(fd)
        if self.writer is not None:
            self.writer.stop()
        end_leftovers(spare=self._warden.pid if self._warden is not None else None)
        if self.saved is not None:  # the rank's output ends: its last words go first
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(self.saved[0], 1)
            os.dup2(self.saved[1], 2)
            os.close(self.saved[0])
            os.close(self.saved[1])
        for sock, _ in self.connected[:2]:
            sock.close()
        for output in self.outputs:
            output.join(config.CLEANUP_WAIT)
        if self.patches is not None:
            self.patches.restore()
        if self.notes is not None:
            self.notes.write("done", self.code)
            self.notes.close()
        if self._warden is not None:
            try:
                self._warden.wait(config.CLEANUP_WAIT)
            except subprocess.TimeoutExpired:
                self._warden.kill()
                self._warden.wait(config.CLEANUP_WAIT)
        if self.stack_file is not None:
            self.stack_file.close()

    def _spawn_child(self, env: Mapping[str, str], cwd: str | None, notes: Notes) -> None:
        """The rank in a child process of this one, given the control stream (waited for
        by :meth:`finish`), started by the node side's spawner."""
        from phalanx.node.spawn import RankSpawner

        keys: str | None = None  # the control socket's frame keys (across a network)
        if len(self.control) == 2:
            stream: tuple[str, Sequence[int]] = ("pipe:{0},{1}", self.control)
        else:
            sock, auth = self.connected[2]
            stream, keys = ("socket:{0}", (sock.fileno(),)), auth.handover()
        try:
            self.child = RankSpawner.start_child(env, cwd, stream, stacks_fd=self.stack_file.fd,
                                                 frame_keys=keys)
        except OSError as exc:  # the rank's death, told on its stderr
            print(f"phalanx: the rank cannot start in {cwd}: {exc}", file=sys.stderr,
                  flush=True)
            self.pid = None
            self._end()
            return
        self.pid = self.child.pid
        notes.write("rank", self.child.pid)  # the warden's rank is this child now
        if len(self.control) == 2:  # the child holds them now
            for fd in self.control:
                os.close(fd)
            self.control = ()
        self.connected[2][0].close()

    def _start_warden(self, stack_file: Any) -> Notes:
        """The rank's warden (:mod:`phalanx.node.warden`), holding the side stream."""
        from phalanx.node import warden

        side, side_auth = self.connected[3]
        notes_r, notes_w = os.pipe()
        env = dict(os.environ)
        if not self.local:
            env[config.ENV_FRAME_KEYS] = side_auth.handover()
        fds = (side.fileno(), notes_r, stack_file.fd)
        try:
            self._warden = subprocess.Popen(
                warden.argv(*fds, os.getpid(), site=not self.local), pass_fds=fds,
                stdin=subprocess.DEVNULL, env=env,
                # a group of its own: Ray kills a dead worker's process group at once,
                # and the warden must outlive the actor to end and report what it left
                start_new_session=True)
        except BaseException:
            os.close(notes_w)
            raise
        finally:
            os.close(notes_r)
            side.close()
        return Notes(notes_w)

    def _redirect_output(self) -> tuple[tuple[int, int], list[Any]]:
        """fds 1 and 2 to the rank's output streams: over a Unix socket the sockets
        themselves, across the network pipes to threads here that seal what is written.
        What the previous ones were (to restore), and the sealing threads."""
        from phalanx.backends.ray.sealed import SealedOutput

        sealed = [SealedOutput(sock, auth) for sock, auth in self.connected[:2]
                  if sock.family != socket.AF_UNIX]
        targets = [sock.fileno() for sock, _ in self.connected[:2]] if not sealed \
            else [output.write_fd for output in sealed]
        sys.stdout.flush()
        sys.stderr.flush()
        saved = (os.dup(1), os.dup(2))
        os.dup2(targets[0], 1)
        os.dup2(targets[1], 2)
        for output in sealed:
            output.start()  # closes its copy of the pipe's write end: fds 1 and 2 hold it
        stream: Any  # a TextIOWrapper, unless something replaced it
        for stream in (sys.stdout, sys.stderr):  # what the rank prints arrives promptly
            try:
                stream.reconfigure(line_buffering=True, write_through=True)
            except (AttributeError, ValueError, OSError):
                pass
        return saved, sealed
