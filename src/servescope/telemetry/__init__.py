"""servescope.telemetry"""
