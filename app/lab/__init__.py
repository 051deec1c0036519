"""The lab: simulated machines' detector inputs in the real formats, the faults `nodus fault`
writes into them, and the machine provider that "repairs" them (reboot, reprovision, migrate
by rewriting their files); used by `nodus up` and the tests. Nothing here touches a real
machine, and no service imports it: `nodus remediator` and `nodus monitor` are handed it."""
