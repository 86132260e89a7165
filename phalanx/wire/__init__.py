"""What travels between processes: byte streams, frames, pickling, the protocol, the handshake.

:mod:`.streams` (pipes, sockets, TLS, the self-pipe), :mod:`.framing` (frames on a byte
stream), :mod:`.pickling` (a payload's pickle and its out-of-band buffers), :mod:`.protocol`
(the messages, and the one definition of a frame's header), :mod:`.handshake` (proving the
shared secret on a fresh connection).

May import: :mod:`phalanx.world` and the top-level modules (errors, config). Never the
controller, a backend, the node or the rank side: both ends of a connection use it.
"""
