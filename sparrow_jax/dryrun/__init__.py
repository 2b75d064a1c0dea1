"""`sparrow dryrun`: compile one RL step for a TPU slice or GPU node without the hardware
(targets.py: the topologies; programs.py: the step's programs; run.py: the report).
"""
