"""`make bench`: each section (compute, profile, attention, comm, sharding, parallel), its rank workers and the report.

scripts/bench.py runs the sections; each module is one section or its rank workers, imported by path.
"""
