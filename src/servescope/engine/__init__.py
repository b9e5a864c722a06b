"""servescope.engine"""
