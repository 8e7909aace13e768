"""What can stand in for a target run: devices, the precision settings of a run (capture, apply,
diff), emulated dtypes and fp8, injected faults, op faults and simulated backends."""
