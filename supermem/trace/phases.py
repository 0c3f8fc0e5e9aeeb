"""The phases of a training step a trace marks (context.py records them, owners.py and the report read
them): their names, their numbers, and the trace events that carry them."""

PHASES = ("", "forward", "backward", "optimizer")
NONE, FORWARD, BACKWARD, OPTIMIZER = range(4)
STEP_MARK = "step"  # a phase event's detail that ends a step (after the optimizer's step)
PHASE_ACTION = "phase"  # the trace's action for a phase change; its detail names the phase begun
