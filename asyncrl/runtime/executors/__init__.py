"""Executors run the rollout side of the async runtime: ``local`` (threads in this process)
or ``ray`` (Ray actors). The controller (async_controller.py) is the same for both."""
