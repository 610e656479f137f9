"""The speculation plan and the step's width: K schedules, execution shapes, per-request caps."""
