"""Machines for tests (execution/machine.py), made through the constructor."""

from ds2cli.execution.machine import Machine


class Quiet:
    """A load reading that finds every core free: a test's passes use every core whatever else
    the machine runs meanwhile (a busy core would leave the helpers out of a plan)."""

    def free(self, most: int, own_pids=()) -> int:
        return most


def quiet_machine(**kwargs) -> Machine:
    """A machine with helper processes whose cores all count as free."""
    return Machine(helpers=True, load=Quiet(), **kwargs)
