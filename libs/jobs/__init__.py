"""A job's life: its transitions, pure (`lifecycle`), and their compare-and-set writes with
the events that record them (`store`)."""
