"""The monitor (`nodus monitor`), one per machine: its detectors read the kernel log, DCGM,
Node Problem Detector and InfiniBand the way those write them, and report signals to the bus
(`nodus-signals`) for the remediator; it also runs the detectors on demand (revalidation)."""
