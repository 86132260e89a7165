"""The world of a group, as pure logic: where ranks sit and what they are told.

Layouts and each rank's variables (:mod:`.layout`), framework environment recipes
(:mod:`.frameworks`), where a group's ranks go (:mod:`.placement`), named sharding
(:mod:`.sharding`), the ``workers=`` selection (:mod:`.selection`), the rows a handle on kept
results names (:mod:`.rowselect`), and what Slurm writes
(:mod:`.slurm`: hostlists, ``scontrol`` records, an srun task's variables). Nothing here opens a
file, a socket or a process, so all of it is tested without spawning anything.

May import: :mod:`phalanx.errors`, :mod:`phalanx.config`, :mod:`phalanx.options` and the
standard library's pure modules. Imported by every layer above.
"""
