"""The gateway's routes by concern: probes, jobs' state, history, live pushes, services' status."""
