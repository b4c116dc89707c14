"""batch_checks op: the batch rows' and new slots' ``INVALID_INPUT`` checks, and which rows are requests."""
