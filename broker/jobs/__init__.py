"""The job book and what changes it: submit, cancel, preempt, agent reports, the cycle shell."""
