"""The Ray backend: ranks are Ray actors in a placement group; calls take phalanx's channel.

:mod:`.backend` (the controller's side, :class:`RayBackend`), :mod:`.actor` (what runs in
each rank's actor), :mod:`.channel` (a rank's streams), :mod:`.placement` (bundles, pure),
:mod:`.session` (this process's connection to Ray), :mod:`.store` (put objects),
:mod:`.detached` (a detached group's agents, kept by Ray as detached actors).

May import: :mod:`phalanx.backends.base`, the node side and the layers below; never another
backend or the controller.
"""
