"""The gate: the report's value objects (Report, Entry, Finding) with their JSON form, and the
policy that judges them. Pure: no torch, no rendering."""
