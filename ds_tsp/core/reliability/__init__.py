"""Failing loudly, never hanging: the watchdog on every TSP wait (watchdog, polling, stall_message), non-finite
losses and grads (nonfinite), and a clean interpreter exit (clean_exit)."""
