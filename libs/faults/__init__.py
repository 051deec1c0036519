"""The GPU node faults Nodus knows (`catalog`): what each detector's signal means, how severe
it is and which repair it asks; shared by the monitor, which reports signals, and the
remediator, which acts on them."""
