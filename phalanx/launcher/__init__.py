"""``phalanx run``: a torchrun-like launcher built on :mod:`phalanx.controller`.

Words, each with one meaning here: the *launcher* is one ``phalanx run`` process; a *run*
is everything one ``phalanx run`` does, across its *attempts*; an *attempt* starts the
group (every rank of the world) and waits for the ranks' programs, numbered from 0
(torchrun's restart count); a *restart* is an attempt after a failed one; a *job* is the
launchers of a ``--nnodes N`` run together, one per node, and its *host* is node 0's. The
group *starts* its ranks (the backend's business, not the launcher's).

The modules, from the top (each imports only those below it)::

    api.py        run(options): picks the kind of launcher; RunOptions, BadOptions
    single.py     one launcher for every rank: attempts, restarts
    multinode.py  one launcher per node (--nnodes N): JobMember follows the job's host
    jobhost.py    node 0's host of a job: admits launchers, starts and stops attempts
    attempt.py    one attempt: start the group, run the program, the first failure
    signals.py    SIGINT/SIGTERM forwarded to the ranks, SIGKILL after the grace period
    program.py    ScriptRunner: what every rank runs (the one module a rank imports)
    policy.py     after an attempt: AttemptStatus in, RestartDecision out (pure)
    roster.py     who forms a job, which failure is the root cause (pure)
    report.py     the failure record, the report, the exit status (pure)
    elastic.py    torchrun's variables for the ranks (pure)
    flags.py      torchrun's command line
    slurmenv.py   under srun: the world's flags from the step, NodeAddr from scontrol
    options.py    the frozen options (plain data)

May import: the controller and every layer below; never the CLI.
"""
