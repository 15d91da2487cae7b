"""How a step runs on the GPUs (or CPU processes): where the multi-GPU code lives.

    dispatch.py   run_step: a step function in this process, or on tp x pp rank processes (failed
                  ranks start again from what the step's `restart_from` reads, e.g. an AR step's
                  halved budget after an OOM); rank_pool for a job's replica
    layout.py     --tensor-parallel-size / --pipeline-parallel-size checked against the model
    ranks.py      RankPool: the rank processes (torch.distributed), their ParallelContext, failures
    replicas.py   a local job's data-parallel replicas: a work queue of shards over RankPools

Steps are passed as functions (`components.ar.run.run`), which the spawned ranks receive by
reference (pickled as module + name), so they must be module-level functions.
"""
