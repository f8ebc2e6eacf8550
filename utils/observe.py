"""--profile and --tensorboard: looking at a run beyond its metrics file.

Placeholder interface (being filled in): TrainingRun calls
    observers = Observers(args, env, start_step)
    observers.step(global_step)   # after every optimizer step
    observers.epoch(record)       # after every epoch record (rank 0 writes)
    observers.close()             # at the end of the run or at a stop
"""


class Observers:
    def __init__(self, args, env, start_step: int = 0):
        self.args, self.env = args, env

    def step(self, global_step: int):
        pass

    def epoch(self, record: dict):
        pass

    def close(self):
        pass
