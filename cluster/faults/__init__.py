"""Fault injection for the reliability tests and the chaos run (benchmarks/chaos.py), apart from
serving: the typed interface the workers offer it (fault_control.py; the router never calls it) and
the decode loop's fault plan (fault_plan.py: consulted at one seam, None in production)."""
