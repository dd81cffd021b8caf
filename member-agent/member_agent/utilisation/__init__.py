"""GPU utilisation from dcgm-exporter, joined to the pods that hold the GPUs, per queue."""
