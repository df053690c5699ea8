# Installation and Debian packages (docs/operations.md, "Installing").
#
#   cmake --install build/release --prefix /usr       # or: DESTDIR=/tmp/root cmake --install ...
#   (cd build/release && cpack -G DEB)                # poseidon-*.deb, one package per component
#
# Components, one Debian package each:
#   server       poseidon-server        the KV server, its systemd unit and default settings
#   coordinator  poseidon-coordinator   the control plane, its unit and default settings
#   agent        poseidon-agent         the per-GPU sidecar, its template unit and settings
#   cuda         poseidon-agent-cuda    the agent's CUDA stager plugin (CUDA builds only)
#   cli          poseidon-cli           the `poseidon` command (run, plan, status)
#   lib          libposeidon1           the C ABI library
#   dev          libposeidon-dev        its header, the unversioned link and the pkg-config file
#   python       python3-poseidon       the Python package (poseidon, poseidon.torch, poseidon.run)
# The units name ${CMAKE_INSTALL_FULL_BINDIR}; packages use the prefix /usr.
include(GNUInstallDirs)

set(POSEIDON_DOC_DIR ${CMAKE_INSTALL_DATADIR}/doc/poseidon)
set(POSEIDON_PLUGIN_DIR lib/poseidon)  # the agent looks in <bin>/../lib/poseidon
set(POSEIDON_PYTHON_INSTALL_DIR lib/python3/dist-packages)  # Debian's path for python3 modules

install(TARGETS poseidon-server RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT server)
install(TARGETS poseidon-coordinator RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        COMPONENT coordinator)
install(TARGETS poseidon-agent RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT agent)
install(TARGETS poseidon RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT cli)
if(TARGET poseidon_cuda_stager)
  # The CUDA runtime and cuBLAS stay where NVIDIA's toolkit put them: the same run path in the
  # build tree and installed (no rewrite at install time).
  set_target_properties(poseidon_cuda_stager PROPERTIES BUILD_WITH_INSTALL_RPATH ON
                        INSTALL_RPATH "${CUDAToolkit_LIBRARY_DIR}")
  install(TARGETS poseidon_cuda_stager LIBRARY DESTINATION ${POSEIDON_PLUGIN_DIR} COMPONENT cuda)
endif()
install(TARGETS libposeidon
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT lib NAMELINK_COMPONENT dev)
install(FILES ${PROJECT_SOURCE_DIR}/libclient/include/poseidon/poseidon.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/poseidon COMPONENT dev)
# Files that name install paths are written at install time, for the prefix installed to (cpack
# installs with /usr whatever the configured prefix): poseidon_install_configured(SRC DEST COMPONENT
# [PERMISSIONS...]) replaces /usr/bin/, /usr/share/ and @PREFIX@/@LIBDIR@/@INCLUDEDIR@ in SRC.
function(poseidon_install_configured src dest component)
  get_filename_component(name ${src} NAME)
  set(out ${PROJECT_BINARY_DIR}/configured/${component}/${name})
  install(CODE "
    file(READ \"${src}\" text)
    string(REPLACE \"/usr/bin/\" \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR}/\" text \"\${text}\")
    string(REPLACE \"/usr/share/\" \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_DATADIR}/\" text \"\${text}\")
    string(REPLACE \"@PREFIX@\" \"\${CMAKE_INSTALL_PREFIX}\" text \"\${text}\")
    string(REPLACE \"@LIBDIR@\" \"${CMAKE_INSTALL_LIBDIR}\" text \"\${text}\")
    string(REPLACE \"@INCLUDEDIR@\" \"${CMAKE_INSTALL_INCLUDEDIR}\" text \"\${text}\")
    string(REPLACE \"@VERSION@\" \"${PROJECT_VERSION}\" text \"\${text}\")
    file(WRITE \"${out}\" \"\${text}\")" COMPONENT ${component})
  install(FILES ${out} DESTINATION ${dest} COMPONENT ${component} ${ARGN})
endfunction()

poseidon_install_configured(${PROJECT_SOURCE_DIR}/cmake/poseidon.pc ${CMAKE_INSTALL_LIBDIR}/pkgconfig
                            dev)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/libclient/python/poseidon
        DESTINATION ${POSEIDON_PYTHON_INSTALL_DIR} COMPONENT python
        PATTERN "__pycache__" EXCLUDE)

# systemd units (the ExecStart path follows the install prefix) and default settings.
foreach(pair "server;poseidon-server.service" "coordinator;poseidon-coordinator.service"
             "agent;poseidon-agent@.service")
  list(GET pair 0 component)
  list(GET pair 1 unit)
  poseidon_install_configured(${PROJECT_SOURCE_DIR}/deploy/systemd/${unit} lib/systemd/system
                              ${component})
  # /etc/poseidon/<daemon>.env: absolute, so that a /usr prefix still installs into /etc.
  install(FILES ${PROJECT_SOURCE_DIR}/deploy/config/${component}.env
          DESTINATION /etc/poseidon PERMISSIONS OWNER_READ OWNER_WRITE COMPONENT ${component})
endforeach()
install(FILES ${PROJECT_SOURCE_DIR}/docs/server.md DESTINATION ${POSEIDON_DOC_DIR} COMPONENT server)
install(FILES ${PROJECT_SOURCE_DIR}/docs/operations.md DESTINATION ${POSEIDON_DOC_DIR}
        COMPONENT coordinator)
install(FILES ${PROJECT_SOURCE_DIR}/docs/agent.md DESTINATION ${POSEIDON_DOC_DIR} COMPONENT agent)
install(FILES ${PROJECT_SOURCE_DIR}/docs/pytorch.md DESTINATION ${POSEIDON_DOC_DIR}
        COMPONENT python)

# ---- CPack: Debian packages ------------------------------------------------------------------
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_PACKAGE_NAME poseidon)
set(CPACK_PACKAGE_VENDOR "Poseidon developers")
set(CPACK_PACKAGE_CONTACT "Poseidon developers <poseidon@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "communication system for data-parallel deep learning on GPU clusters")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)  # dpkg-shlibdeps: Depends from the linked libraries
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_DEBIAN_SERVER_PACKAGE_NAME poseidon-server)
set(CPACK_DEBIAN_COORDINATOR_PACKAGE_NAME poseidon-coordinator)
set(CPACK_DEBIAN_AGENT_PACKAGE_NAME poseidon-agent)
set(CPACK_DEBIAN_CUDA_PACKAGE_NAME poseidon-agent-cuda)
set(CPACK_DEBIAN_CLI_PACKAGE_NAME poseidon-cli)
set(CPACK_DEBIAN_LIB_PACKAGE_NAME libposeidon1)
set(CPACK_DEBIAN_DEV_PACKAGE_NAME libposeidon-dev)
set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME python3-poseidon)
set(CPACK_DEBIAN_PYTHON_PACKAGE_ARCHITECTURE all)
set(CPACK_DEBIAN_SERVER_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/debian/server/conffiles)
set(CPACK_DEBIAN_COORDINATOR_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/debian/coordinator/conffiles)
set(CPACK_DEBIAN_AGENT_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/deploy/debian/agent/conffiles)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "libposeidon1 (= ${PROJECT_VERSION}-1)")
set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS "python3, libposeidon1 (= ${PROJECT_VERSION}-1)")
set(CPACK_DEBIAN_PYTHON_PACKAGE_SUGGESTS "python3-torch")
# `poseidon run` starts the daemons of a local cluster through the Python launcher.
set(CPACK_DEBIAN_CLI_PACKAGE_DEPENDS "python3-poseidon (= ${PROJECT_VERSION}-1)")
set(CPACK_DEBIAN_CLI_PACKAGE_RECOMMENDS "poseidon-server, poseidon-coordinator, poseidon-agent")
set(CPACK_DEBIAN_CUDA_PACKAGE_DEPENDS "poseidon-agent (= ${PROJECT_VERSION}-1)")
# With the RDMA transport every executable linking poseidon_transport (poseidon-server,
# poseidon-agent) needs libibverbs.so.1: dpkg-shlibdeps adds `libibverbs1` to their Depends from
# the linked library (as for gRPC and protobuf). The verbs providers that drive a real device come
# from ibverbs-providers (rdma-core), recommended: without one, --transport=auto falls back to TCP.
if(POSEIDON_RDMA_ENABLED)
  set(CPACK_DEBIAN_SERVER_PACKAGE_RECOMMENDS "ibverbs-providers")
  set(CPACK_DEBIAN_AGENT_PACKAGE_RECOMMENDS "ibverbs-providers")
endif()
# The CUDA runtime and cuBLAS come from NVIDIA's toolkit under /usr/local/cuda, not a Debian
# package: dpkg-shlibdeps cannot name a package for them.
set(CPACK_DEBIAN_CUDA_PACKAGE_SHLIBDEPS OFF)
set(CPACK_COMPONENTS_ALL server coordinator agent cli lib dev python)
if(TARGET poseidon_cuda_stager)
  list(APPEND CPACK_COMPONENTS_ALL cuda)
endif()
include(CPack)
