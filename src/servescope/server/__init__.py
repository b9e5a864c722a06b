"""servescope.server"""
