"""phase op: one HEAD or TAIL phase of a canary group (plans, verify and write of K and V, ring, counters) fused."""
