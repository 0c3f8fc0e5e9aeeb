"""The phases of a training step a trace marks (context.py records them, owners.py and the report read
them): their names, their numbers, and the trace events that carry them."""

PHASES = ("", "forward", "backward", "optimizer")
NONE, FORWARD, BACKWARD, OPTIMIZER = range(4)
STEP_MARK = "step"  # a phase event's detail that ends a step (after the optimizer's step)
PHASE_ACTION = "phase"  # the trace's action for a phase change; its detail names the phase begun
# A module call begun in a forward (context.py): "call" at its start (its path in detail, its first tensor
# argument's data_ptr in address), "return" at its end (the type of an argument that is state, not a
# value, in detail), and an "output" there per tensor it returned (its data_ptr in address); the events
# of one call carry its number in tag
CALL_ACTION, RETURN_ACTION, OUTPUT_ACTION = "call", "return", "output"
