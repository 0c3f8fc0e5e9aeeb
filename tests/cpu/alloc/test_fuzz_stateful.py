"""The fuzz model as a Hypothesis state machine: fewer, shorter runs than test_fuzz, but a failure
shrinks to a minimal op sequence."""

import hypothesis.strategies as st
from alloc_spec import MiB
from fuzz_model import LIMITS, AllocatorModel
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

STREAMS = (0, 1, 2)
sizes = st.one_of(
    st.integers(0, 4096),
    st.integers(4096, 2 * MiB),
    st.integers(2 * MiB, 24 * MiB),
    st.sampled_from((512, 513, MiB, MiB + 1, 10 * MiB, 20 * MiB, 1 << 50, 1 << 61)),
)
picks = st.integers(0, 1 << 16)  # an index into the live blocks, taken modulo their count


class AllocatorMachine(RuleBasedStateMachine):
    expandable = False

    def __init__(self):
        super().__init__()
        self.m = AllocatorModel(64 * MiB, streams=STREAMS, expandable=self.expandable)

    def _pick(self, i):
        return list(self.m.blocks)[i % len(self.m.blocks)]

    @rule(nbytes=sizes, stream=st.sampled_from(STREAMS))
    def malloc(self, nbytes, stream):
        self.m.malloc(nbytes, stream)

    @precondition(lambda self: self.m.blocks)
    @rule(i=picks)
    def free(self, i):
        self.m.free(self._pick(i))

    @precondition(lambda self: self.m.blocks)
    @rule(i=picks, stream=st.sampled_from(STREAMS))
    def record_stream(self, i, stream):
        self.m.record_stream(self._pick(i), stream)

    @rule(hold=st.booleans())
    def hold_events(self, hold):
        self.m.hold_events(hold)

    @rule()
    def empty_cache(self):
        self.m.empty_cache()

    @rule(limit=st.sampled_from(tuple(x // 3 for x in LIMITS)))
    def set_limit(self, limit):
        self.m.set_limit(limit)

    @rule()
    def toggle_capture(self):
        if self.m.capture:
            self.m.end_capture()
        else:
            self.m.begin_capture()

    @precondition(lambda self: self.m.pools and not self.m.capture)
    @rule(i=picks)
    def release_pool(self, i):
        self.m.release_pool(self.m.pools[i % len(self.m.pools)])

    @invariant()
    def matches_the_model(self):
        self.m.check()

    def teardown(self):
        self.m.live.cookies.verify_all()
        self.m.free_all()
        self.m.check()


class ExpandableAllocatorMachine(AllocatorMachine):
    expandable = True


SETTINGS = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,  # CI runs are reproducible; explore with --hypothesis-seed
    suppress_health_check=[HealthCheck.too_slow],
)
AllocatorMachine.TestCase.settings = SETTINGS
ExpandableAllocatorMachine.TestCase.settings = SETTINGS
TestAllocatorMachine = AllocatorMachine.TestCase
TestExpandableAllocatorMachine = ExpandableAllocatorMachine.TestCase
