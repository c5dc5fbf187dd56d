"""What talks to the grading service or stands in for it: ``client`` (HTTP, sync and async),
``adapters`` (verl, OpenRLHF and TRL reward functions: the service, or an in-process pool) and
``loadgen`` (an RL-shaped grading workload, through the service and in-process)."""
