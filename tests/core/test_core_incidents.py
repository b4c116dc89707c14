"""Incidents: the rows each demo fault kind writes (transcribed from demo runs) fold into one headline per fault."""

import pytest

from kvcanary_jax import CanaryLaunchTag, FailReason, InputField, InputProblem, Violation
from kvcanary_jax.core import _incidents

T, F = CanaryLaunchTag, FailReason
KV, CHAIN, POS, TOK, WTOK = (F.VERIFY_REAL_KV_HASH, F.VERIFY_CHAIN_HASH, F.VERIFY_POSITION, F.VERIFY_TOKEN,
                             F.WRITE_TOKEN)  # fmt: skip


def _row(tag, slot, position, stored, expected, reason, request=None, expected_position=None, entry=None, detail=0):
    """A decoded row as the ring holds it (hashes left 0: incidents do not read them)."""
    return Violation(
        tag, slot, position, stored, expected, 0, 0, F(reason), detail, request,
        position if expected_position is None else expected_position, entry,
    )  # fmt: skip


_KV_CAUSE = (
    "  likely cause: KV bytes of this slot changed after they were written: during this step's forward (a kernel "
    "wrote the wrong slot) or between steps"
)
_REMAP_CAUSE = (
    "  likely cause: the slot holds another token than the request's history: it maps to another request's KV, or "
    "to a stale page"
)
_SWAP_CAUSE = (
    "  likely cause: the token written is not the one the oracle expects: sampled tokens were crossed between "
    "requests, or a stale input was fed"
)

# fault kind -> (rows one step wrote, the headlines they give)
GOLDEN = {
    "live_kv FULL": (
        [_row(T.TAIL_K_FULL, 179, 26, 68, 68, KV, 4, 26, 3)],
        ["kv-canary incident #1: verify_real_kv_hash (TAIL_K_FULL) at request row 4, position 26, slot 179 (FULL), "
         "written at step 12\n" + _KV_CAUSE + "\n  explains 1 row(s)"],
    ),
    "live_kv SWA": (
        [_row(T.TAIL_K_SWA, 130, 58, 158, 158, KV, 2, 58, 1)],
        ["kv-canary incident #1: verify_real_kv_hash (TAIL_K_SWA) at request row 2, position 58, slot 130 (SWA), "
         "written at step 12\n" + _KV_CAUSE + "\n  explains 1 row(s)"],
    ),
    "post_forward_kv SWA": (
        [_row(T.TAIL_K_SWA, 92, 31, 162, 162, KV, 3, 31, 2)],
        ["kv-canary incident #1: verify_real_kv_hash (TAIL_K_SWA) at request row 3, position 31, slot 92 (SWA), "
         "written at step 12\n" + _KV_CAUSE + "\n  explains 1 row(s)"],
    ),
    "idle_cache_kv FULL": (
        [_row(T.SWEEP_K_FULL, 62, 37, 220, -1, KV, None, 37)],
        ["kv-canary incident #1: verify_real_kv_hash (SWEEP_K_FULL) at an idle prefix-cache slot, position 37, "
         "slot 62 (FULL), written at step 12\n  likely cause: KV bytes of an idle prefix-cached slot changed: the slot "
         "was overwritten while cached (an allocation or eviction bug)\n  explains 1 row(s)"],
    ),
    "req_to_token FULL": (  # entry 16 of request row 3 remapped to slot 260 (position 25 of another request)
        [_row(tag, slot, position, stored, expected, reason, 3, expected_position, 2)
         for tag in (T.HEAD_K_FULL, T.HEAD_K_SWA, T.TAIL_K_FULL, T.TAIL_K_SWA)
         for slot, position, stored, expected, reason, expected_position in (
             (138, 17, 182, 182, CHAIN, 17),  # the knock-on comes first in the ring
             (260 if tag.name.endswith("FULL") else 5, 25, 219, 191, CHAIN | POS | TOK, 16),
         )],
        ["kv-canary incident #1: verify_chain_hash+verify_position+verify_token (HEAD_K_FULL) at request row 3, "
         "position 16, slot 260 (FULL), written at step 12\n" + _REMAP_CAUSE + "\n  explains 8 row(s); knock-ons of "
         "this root at slot@position 138@17"],
    ),
    "token_swap FULL": (  # the sampled tokens of request rows 6 and 2 crossed
        [_row(tag, slot, position, stored, expected, WTOK, request, position, entry)
         for request, slot, swa_slot, position, stored, expected, entry in (
             (6, 393, 58, 47, 132, 37, 27), (2, 390, 91, 74, 37, 132, 24))
         for tag in (T.HEAD_K_FULL, T.HEAD_K_SWA, T.TAIL_K_FULL, T.TAIL_K_SWA)
         for slot in ((slot,) if tag.name.endswith("FULL") else (swa_slot,))],
        ["kv-canary incident #1: write_token (HEAD_K_FULL) at request row 6, position 47, slot 393 (FULL), written "
         "at step 12\n" + _SWAP_CAUSE + "\n  explains 8 row(s); tokens crossed with request row 2, position 74, "
         "slot 390"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("fault", sorted(GOLDEN))
def test_each_demo_fault_gives_one_headline(fault):
    rows, headlines = GOLDEN[fault]
    incidents = _incidents.group(rows, step=12)
    assert [i.headline() for i in incidents] == headlines
    assert sum(i.rows for i in incidents) == len(rows)


def test_an_unwritten_request_is_one_incident_over_later_steps():
    """A slot-0 entry leaves request row 1 unwritten: its later verify rows are knock-ons, counted, not new."""
    detail = InputField.REQ_TO_TOKEN | InputProblem.RESERVED_SLOT << 8
    # an input row: slot, position, value, limit, entry, request row (expected_aux), bits, detail, context
    bad = Violation(T.HEAD_K_FULL, 0, 5, 0, -1, 0, 1, F.INVALID_INPUT, detail, 1, 5, 0)
    tracker = _incidents.Incidents()
    tracker.add([bad], step=3)
    later = [_row(t, 40 + p, p, 0, -1, CHAIN | POS, 1, p, 0) for p in (6, 7) for t in (T.HEAD_K_FULL, T.HEAD_V_FULL)]
    placed = tracker.add(later, step=4) + tracker.add(later, step=5)
    (incident,) = tracker.incidents
    assert {i.number for _, i in placed} == {1} and incident.rows == 9 and incident.last_step == 5
    assert incident.headline().splitlines()[0] == (
        "kv-canary incident #1: invalid_input (HEAD_K_FULL) at request row 1, req_to_token[1, 5] (batch row 0) = 0 "
        "is the reserved padding slot 0, inside a request, written at step 3"
    )
    assert incident.headline().endswith("explains 9 row(s); knock-ons of this root at slot@position 46@6, 47@7")
    assert incident.label(later[0]).startswith("  incident: knock-on of #1 (root: request row 1, req_to_token")
    another = _row(T.HEAD_K_FULL, 9, 2, 0, -1, CHAIN, 2, 2, 1)
    assert [i.number for _, i in tracker.add([another], step=6)] == [2], "another request's fault is a new incident"


def test_a_bad_span_naming_no_request_takes_the_unwritten_slots_of_later_steps():
    """An extend_lens span past the token arrays names no request row, but leaves the requests from it on unwritten:
    later verify rows of never-written slots (records all zero) are its knock-ons, and so are those requests' later
    rows; a row of a written slot is another fault."""
    detail = InputField.EXTEND_LENS | InputProblem.PAST_TOKENS << 8
    bad = Violation(T.HEAD_K_FULL, -1, -1, 4, 3, 0, -1, F.INVALID_INPUT, detail, None, None, 0)
    blank = lambda tag, slot, request, reason=CHAIN | POS: _row(tag, slot, 0, 0, -1, reason, request, 2)  # noqa: E731
    tracker = _incidents.Incidents()
    tracker.add([bad], step=2)
    unwritten = [blank(T.HEAD_K_FULL, 3, 0), blank(T.HEAD_K_FULL, 23, 2), blank(T.TAIL_K_FULL, 23, 2, CHAIN | POS | KV)]
    tracker.add(unwritten, step=3)
    later = _row(T.HEAD_K_FULL, 24, 3, 503, -1, CHAIN, 2, 3)  # request row 2 again, a written slot: still a knock-on
    written = _row(T.HEAD_K_FULL, 40, 5, 77, -1, CHAIN, 1, 5)  # another request, a written slot: a fault of its own
    placed = tracker.add([later, written], step=4)
    assert [i.number for _, i in placed] == [1, 2]
    first = tracker.incidents[0]
    assert first.rows == 5 and first.partners == [] and first.knock_ons[0].slot_idx == 3
    knock_ons = "  explains 5 row(s); knock-ons of this root at slot@position 3@2, 23@2, 24@3"
    assert first.headline().splitlines()[-1] == knock_ons
    assert first.label(later) == (
        "  incident: knock-on of #1 (root: extend_lens[0]: the token entries of batch row 0 (sum(extend_lens[:1]) = 4) "
        "run past the 3 token entries of the batch (input_ids, positions, out_cache_loc))"
    )
