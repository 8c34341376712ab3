"""The job report: ``report.json`` and ``report.png`` of an output directory."""
