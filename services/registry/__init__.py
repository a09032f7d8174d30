"""The registry: membership of each job, heartbeats and failure detection."""
