"""The routing lab: whole load tests in virtual time over the simulator's engine model."""
