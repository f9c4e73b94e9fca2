"""polyshard.pp: Pipeline parallelism: partitioning, schedules as data, one executor, a simulator."""
