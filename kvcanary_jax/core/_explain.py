"""Our lines after SGLang's violation message: which request, what was expected and found, and the likely cause."""

from __future__ import annotations

from kvcanary_jax.core._constants import CanaryLaunchTag, FailReason, InputField, InputProblem

_KV = FailReason.VERIFY_REAL_KV_HASH_MISMATCH
_MAPPING = FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH
_WRITE = FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH

# (fail reason, phase or None for any) -> likely cause; the first that matches a row names it.
_CAUSES = [
    (FailReason.INVALID_INPUT, None, "the batch holds a value the canary cannot check as given (see 'input:'); the "
     "engine's batch does not follow the pool's conventions, or its tables are corrupt"),
    (FailReason.SHARD_CHAIN_MISMATCH, None, "tensor-parallel shards wrote different records for this slot: one shard "
     "saw another token, position or chain than its peers"),
    (FailReason.WRITE_TOKEN_MISMATCH, None, "the token written is not the one the oracle expects: sampled tokens were "
     "crossed between requests, or a stale input was fed"),
    (FailReason.WRITE_POSITION_MISMATCH, None, "positions do not follow one another along the request: a position was "
     "skipped, repeated or reordered"),
    (FailReason.VERIFY_TOKEN_MISMATCH, None, "the slot holds another token than the request's history: it maps to "
     "another request's KV, or to a stale page"),
    (_KV, "HEAD", "KV bytes of this slot changed since they were written"),
    (_KV, "TAIL", "KV bytes of this slot changed after they were written: during this step's forward (a kernel wrote "
     "the wrong slot) or between steps"),
    (_KV, "SWEEP", "KV bytes of an idle prefix-cached slot changed: the slot was overwritten while cached (an "
     "allocation or eviction bug)"),
    (_MAPPING, "HEAD", "req_to_token maps this position to a slot holding another token's record: a wrong page/slot "
     "mapping, a stale prefix-cache page, or a slot freed and reused while still referenced"),
    (_MAPPING, "TAIL", "this slot's record differs from its chain after the forward: the page table or the slot's "
     "record changed during the step"),
    (_MAPPING, "SWEEP", "the prefix cache's path no longer matches the slots' records: a cached node's slots were "
     "remapped or reused"),
]  # fmt: skip

_PROBLEMS = {
    InputProblem.OUT_OF_RANGE: "is out of range (limit {limit})",
    InputProblem.NEGATIVE: "is negative",
    InputProblem.RESERVED_ROW: "is the reserved padding row 0, but the row is a request (it has a cached prefix or "
    "writes a real slot)",
    InputProblem.RESERVED_SLOT: "is the reserved padding slot 0, inside a request",
    InputProblem.PAST_CONTEXT: "(prefix_lens + extend_lens) exceeds req_to_token's width {limit}",
    InputProblem.UNADOPTED: "was never adopted (missing from the entries, rejected itself, or a cycle): not adopted",
}


def phase_of(tag) -> str | None:
    """``"HEAD"``, ``"TAIL"`` or ``"SWEEP"`` of a launch tag (None for an unknown tag)."""
    return tag.name.split("_")[0] if isinstance(tag, CanaryLaunchTag) else None


def likely_cause(v) -> str | None:
    """One line on what most likely went wrong, for a :class:`Violation`."""
    phase = phase_of(v.launch_tag)
    for reason, where, text in _CAUSES:
        if v.fail_reason & reason and where in (None, phase):
            return text
    return None


def input_line(v) -> str:
    """What an ``INVALID_INPUT`` row says about the batch: the field, the entry, the value and the problem."""
    field, problem = v.reason_detail & 0xFF, (v.reason_detail >> 8) & 0xFF
    try:
        field, problem = InputField(field), InputProblem(problem)
    except ValueError:
        return f"unknown input problem (detail={v.reason_detail:#x})"
    entry, value, limit = v.stored_chain_hash, v.stored_token, v.expected_token
    if field is InputField.REQ_TO_TOKEN:
        where = f"req_to_token[{v.expected_aux}, {v.position}] (batch row {entry})"
    elif field is InputField.FULL_TO_SWA_INDEX_MAPPING:
        where = f"full_to_swa_index_mapping[{v.slot_idx}] (request row {v.expected_aux}, position {v.position})"
    elif field is InputField.OUT_CACHE_LOC:
        where = f"out_cache_loc[{entry}] (request row {v.expected_aux}, position {v.position})"
    elif field.name.startswith("SWEEP_"):
        column = field.name.removeprefix("SWEEP_").lower()
        where = f"prefix-cache sweep entry SweepEntries.{column}[{entry}] (slot {v.slot_idx}, position {v.position})"
    else:
        where = f"{field.name.lower()}[{entry}]"
    if problem is InputProblem.PAST_TOKENS:  # the value is the rows' token count, not extend_lens[entry] itself
        rows = f"row {entry}" if entry == 0 else f"rows 0..{entry}"
        return (
            f"{where}: the token entries of batch {rows} (sum(extend_lens[:{entry + 1}]) = {value}) run past the "
            f"{limit} token entries of the batch (input_ids, positions, out_cache_loc)"
        )
    return f"{where} = {value} " + _PROBLEMS[problem].format(limit=limit)


def explain(v, *, written_step: int | None = None) -> list[str]:
    """Our lines for one :class:`Violation`, after SGLang's message."""
    lines = []
    if v.fail_reason & FailReason.INVALID_INPUT:
        lines.append(f"  input: {input_line(v)}")
    elif v.request_row is not None or v.expected_position is not None:
        request = f"row={v.request_row}" if v.request_row is not None else "row unknown"
        entry = f" (batch entry {v.batch_entry})" if v.batch_entry is not None else ""
        expected = v.expected_position if v.expected_position is not None else "unknown"
        lines.append(f"  request: {request}{entry} position expected={expected} found={v.position}")
    if v.fail_reason & (FailReason.INVALID_INPUT | FailReason.SHARD_CHAIN_MISMATCH):
        pass  # their token fields hold other things (the value received; the consensus's token)
    elif v.fail_reason & FailReason.WRITE_TOKEN_MISMATCH or (not v.fail_reason & _WRITE and v.expected_token != -1):
        lines.append(f"  token: expected={v.expected_token} found={v.stored_token}")
    elif v.fail_reason & _WRITE:
        lines.append(f"  token: found={v.stored_token} (no token mismatch)")
    else:
        lines.append(f"  token: found={v.stored_token} (token not checked)")
    if written_step is not None:
        lines.append(f"  written at step {written_step}")
    cause = likely_cause(v)
    if cause is not None:
        lines.append(f"  likely cause: {cause}")
    return lines
