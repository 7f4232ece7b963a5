"""The runs wing: one run's life from start to resumable stop (MLflow tracking, checkpoints, resume,
claims, signals, full disks, heartbeat, progress) and the UI that shows the runs."""
