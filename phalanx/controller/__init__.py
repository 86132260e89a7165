"""The controller side: ``WorkerGroup`` and the parts it is made of.

:mod:`.group` (the public class), :mod:`.dispatch` (the event pump: channels' events to
futures), :mod:`.futures` (a call's results), the call kinds (:mod:`.meshcalls`,
:mod:`.streaming`, :mod:`.methods`), :mod:`.startup`, :mod:`.watch` and :mod:`.watchdog`
(health, stacks, hangs), :mod:`.lifecycle` (recreate, restart, reload),
:mod:`.membership` (nodes coming and going), :mod:`.shared` (``put()`` and its handles),
:mod:`.injection` (``inject_fault``), :mod:`.spmd`.

May import: :mod:`phalanx.backends` (through :mod:`phalanx.backends.base`, the boundary,
and the factory), and every layer below. Imported only by the launcher, the CLI and the
public API.
"""
