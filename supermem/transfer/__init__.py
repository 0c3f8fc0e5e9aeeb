"""Host memory and copy engines, shared by the tensor pool, weight streaming and checkpoint graphs:
pinned host blocks from one process-wide pool (host.py) and the device-host copy streams with their
measured rates (copy.py)."""
