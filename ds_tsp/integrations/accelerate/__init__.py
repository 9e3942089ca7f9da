"""Accelerate: TSPAccelerator (accelerator), data-axis loaders (dataloaders), what the launcher config asks for
(launch_config)."""
