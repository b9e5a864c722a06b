"""Step records, request metrics and trace export: plain data, no torch."""
