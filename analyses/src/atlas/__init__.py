"""The atlas: every head's scores over every checkpoint of a run. The analyses a sweep can run, each
one file (`registry/`), one pass that shares a forward between the detectors (`atlas_pass`), the
sweep itself with its executors (`sweep`, `executors`: local or Ray, resumable), and the report
(`report`)."""
