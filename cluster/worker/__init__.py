"""What a worker is built from and measured by: its frozen WorkerConfig and the PassRateMeter of its passes."""
