"""phalanx's release, in one place: what a rank, an agent and a controller compare before
they trust each other's frames (:mod:`phalanx.wire.handshake`), and ``phalanx.__version__``."""

__version__ = "0.1.0"
