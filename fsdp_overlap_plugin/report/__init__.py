"""Everything a person reads: the schedule report, the cost model, messages."""
